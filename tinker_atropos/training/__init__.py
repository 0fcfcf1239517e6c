"""The training floor, below the algorithms, the drivers (``trainer/``) and the front-ends, and knowing no transport:
the training core (``core``), the replay buffer of an off-policy learner (``replay``), Tinker's losses (``losses``)
and the one guard every driver puts around an update, undoing one that comes out non-finite (``guard``)."""
