"""Error types for user mistakes, kept apart from internal bugs.

Every public entry point raises `InvalidValue` / `InvalidType` for a caller's mistake, with a
message naming the argument, the value and what is expected. They subclass ValueError /
TypeError, so `except ValueError` keeps working; the CLI prints a `UserError` as one line
(exit 2) and anything else as a bug report.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in how exactspec was called (an argument, a file, a combination of options)."""


class InvalidValue(UserError, ValueError):
    """An argument has the right type but a value that cannot be used."""


class InvalidType(UserError, TypeError):
    """An argument has the wrong type."""


class MissingFile(UserError, FileNotFoundError):
    """A file or directory the caller named does not exist."""
