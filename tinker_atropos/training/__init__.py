"""The training floor, below the algorithms, the drivers (``trainer/``) and the front-ends, and knowing no transport:
the training core (``core``), the replay buffer of an off-policy learner (``replay``), the models the Tinker API
serves and the Atropos loop trains (``served``, with ``run_loss``), Tinker's losses (``losses``), what their data
must be (``data``), an Atropos batch as Tinker datums (``atropos_batches``: the Atropos loop's maths), and the one guard every driver puts around an update, undoing one that comes out non-finite
(``guard``)."""
