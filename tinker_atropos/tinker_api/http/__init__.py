"""The Tinker API's HTTP surface: ``app`` builds the FastAPI app, ``routes/`` answers the SDK's routes by queueing
requests in the store and reading their futures. It never imports the engine."""
