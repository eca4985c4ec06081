"""The base of every error a user can cause through the library (bad data, bad options, a run that cannot go
on), as opposed to a bug.

The message says what is wrong in the library's own terms. `field` names the setting it is about (a field of
`TrainingConfig`, `HealConfig`, ... such as "max_steps"), `kind` the situation (for example "run_completed");
a front end (the CLI) uses them to add what the user can do next in its own terms (its flags and commands).
"""

from __future__ import annotations


class UserError(ValueError):
    def __init__(self, message: str, *, kind: str | None = None, field: str | None = None):
        super().__init__(message)
        self.kind, self.field = kind, field
