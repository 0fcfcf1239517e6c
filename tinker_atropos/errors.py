"""Failures a restart cannot fix, and the exit code that says so: what every layer may raise without importing
the services that report it."""

from __future__ import annotations

# A service exits with EXIT_FATAL for a failure that a restart cannot fix (a bad config or env, a training run
# that diverged): `up` stops the run instead of restarting it. Any other non-zero code is worth a restart.
EXIT_FATAL = 2


class FatalError(Exception):
    """A failure a restart cannot fix; the command prints its one-line message and exits with EXIT_FATAL."""


class EnvError(FatalError, ValueError):
    """An env that cannot be served; the message is one line that names the problem."""
