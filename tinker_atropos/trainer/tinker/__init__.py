"""The Tinker API's driver and engine: ``driver.py`` serves the HTTP API (``frontends/tinker/``) and runs the
``worker``, which takes the requests the API queued in the store and applies each model's in order (``requests``
what each kind does, ``checkpoints`` the files it writes, ``sampling`` the sampling process, ``recovery`` the models rebuilt after a restart, ``expiry`` the sessions
whose client went silent). The API and the worker meet only at the store (``frontends/tinker/store/``)."""
