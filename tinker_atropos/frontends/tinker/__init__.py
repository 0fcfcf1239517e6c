"""A Tinker-compatible training API on the trainer: the official ``tinker`` SDK (0.38.0) drives our models.

``app`` with its ``routes`` is the HTTP surface; ``store`` keeps in Redis and the checkpoint folder everything it
must not lose (sessions, models, requests and their futures, samplers, training runs and their checkpoints), and
is where it meets the worker that applies the requests (``trainer/tinker/``, a driver of the trainer). ``wire``
reads and writes the SDK's own Protobuf and JSON types, ``base_models`` names the models it can serve and builds
them (the models, their losses and data checks are the training floor's: ``training.served``, ``training.losses``,
``training.data``), and ``stability`` keeps the samplers' record ``stable_reinforce`` trains on.
"""
