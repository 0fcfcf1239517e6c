"""The Tinker API's routes, one router per resource (``app.py`` includes them)."""
