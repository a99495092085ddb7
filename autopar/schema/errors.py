"""Errors that users act on.

`PlanError` is raised for every infeasible or invalid request: the message says what failed and
how to fix it. The CLI prints it as one line and exits non-zero.
"""

from __future__ import annotations


class PlanError(Exception):
    """An infeasible or invalid planning/run request, with a reason a user can act on."""

    def __init__(self, message: str, *, min_memory_bytes: float | None = None,
                 constraint: str | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.constraint = constraint
