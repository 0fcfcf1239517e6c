"""A Tinker-compatible training API on the trainer: the official ``tinker`` SDK (0.38.0) drives our models.

Its rooms, bottom to top (``tests/unit/test_layering.py`` holds them):

- ``wire``: the SDK's own Protobuf and JSON types, read and written;
- ``base_models``: which models a base-model name builds (the models, their losses and data checks are the training
  floor's: ``training.served``, ``training.losses``, ``training.data``);
- ``store/``: everything it must not lose, in Redis and the checkpoint folder (sessions, models, the request queue
  and its futures, samplers, training runs, checkpoints, the sampled sequences ``stable_reinforce`` trains on);
- ``http/``: the FastAPI app and its routes, which queue requests in the store and read their futures;
- ``engine/``: the worker that applies the queued requests, its sampling process and the weights it writes;
- ``service``: the trainer's driver that runs the HTTP app and the engine, which meet only at the store.
"""
