"""The base class of every error a user can cause.

Each module defines its own errors (`ConfigError`, `DataError`, `ModelResolutionError`,
...) as subclasses of `RecurformerError`, with a one-line message that names the problem
and the bad value. The command line catches this one class and prints the message as it
is; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class RecurformerError(Exception):
    """A problem with the user's input or environment, described in one line."""
