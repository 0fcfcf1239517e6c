"""The Tinker API's engine: the ``worker`` takes the requests the HTTP app queued in the store and applies each
model's in order (``handlers`` what each kind does, ``dispatch`` which run next and together, ``saving`` the
checkpoint files it writes, ``weights_out`` the formats weights leave in, ``sampling_process`` the sampling process,
``recovery`` the models rebuilt after a restart, ``expiry`` the sessions whose client went silent)."""
