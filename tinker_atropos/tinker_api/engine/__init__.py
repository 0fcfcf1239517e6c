"""The Tinker API's engine: the ``worker`` takes the requests the HTTP app queued in the store and applies each
model's in order (``dispatch`` which run next and together, ``lanes`` the lanes' state its threads share,
``applying`` how a request is applied and recorded for good, ``handlers`` the table of what each kind does:
``live_models`` the served models and their lifecycle, ``training_steps`` forward_backward and optim_step,
``save_requests`` the saves, written by ``saving`` (the checkpoint files), ``sample_requests`` the hand-off to
``sampling_process``, the sampling process; ``responses`` what every handler shares, ``weights_out`` the formats
weights leave in, ``recovery`` the models rebuilt after a restart, ``expiry`` the sessions whose client went
silent)."""
