"""A Tinker-compatible training API on the trainer: the official ``tinker`` SDK (0.38.0) drives our models.

``wire`` reads and writes the SDK's own Protobuf and JSON types, ``store`` keeps sessions, models and futures
in Redis, ``base_models`` builds the models it can serve (the models, their losses and data checks are the
training floor's: ``training.served``, ``training.losses``, ``training.data``), ``worker`` runs each model's
requests in order (``requests`` what each kind does, ``checkpoints`` the files on disk), ``stability`` keeps the
samplers' record ``stable_reinforce`` trains on, and ``app`` with its ``routes`` is the HTTP surface.
"""
