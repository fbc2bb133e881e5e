"""The base of every error that is the user's to fix (a setting, a file, the hub, the disk).

Its message already names the file, key or value and the fix, so the console shows the message
alone; anything else is a bug, and is shown with its type (the stack trace is in the run's log).
"""

from __future__ import annotations


class UserError(Exception):
    """Raised for bad input or a broken environment; the message says what to do."""


def user_error_names() -> set[str]:
    """Class names of every UserError subclass (errors cross process boundaries as names)."""
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names
