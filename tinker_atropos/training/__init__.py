"""The training floor, below the algorithms, the drivers (``trainer/``) and the front-ends, and knowing no transport:
the training core (``core``), the replay buffer of an off-policy learner (``replay``) and Tinker's losses
(``losses``)."""
