"""Front-ends of the training core: ways for something outside the run to drive learning (docs/architecture.md,
the data flow). The Redis experience loop is the trainer's own (``trainer.experience_loop``); here are the HTTP
APIs."""
