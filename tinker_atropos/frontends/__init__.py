"""The run's HTTP front-ends, the ways in from outside (docs/architecture.md, the data flow), each named by what it
serves and run where its service says: ``atropos/`` the Atropos trajectory API (its own process, ``atropos-api``),
``inference/`` the sampling endpoint of the Atropos loop (in the trainer, ``trainer.atropos``); ``http.py`` and
``bodies.py`` what they share (keys, bounded bodies, the server thread), which the Tinker API (``tinker_api/``) uses
too. The maths they feed (losses, datums) is the training floor's, the drivers that learn ``trainer/``'s."""
