"""The errors lmforge reports to a user, and how the command line turns them into exit statuses.

Every error a stage raises for bad input or a failed job derives from ``LmforgeError``; each
keeps its builtin base too (``CheckpointError`` is still a ``ValueError``), so callers that catch
``ValueError`` or ``RuntimeError`` keep working. ``lmforge_cli.main`` catches them in one place,
prints ``error: <message>`` (and the fix) on stderr and exits with ``exit_code``: 2 for a usage
error (a flag or input the user must change), 1 for a failure.
"""

from __future__ import annotations


class LmforgeError(Exception):
    """An error with a message for the user: it names the field, file or path, and the fix.

    Args:
        message: what is wrong, naming the flag / field / path and the offending value.
        fix: what to do about it; appended to the message when given (``message; fix``).

    Attributes:
        exit_code: the process exit status ``lmforge`` returns for it (1: a failure).
    """

    exit_code = 1

    def __init__(self, message: str = "", *args: object, fix: str | None = None) -> None:
        super().__init__(message, *args)
        self.message = str(message)
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message}; {self.fix}" if self.fix else self.message


class UsageError(LmforgeError, ValueError):
    """A flag, value or input file the user must change (exit status 2)."""

    exit_code = 2


class CheckpointError(LmforgeError, ValueError):
    """A checkpoint is missing, corrupt or unsupported; the message names the file and the fix."""


class EmptyModelError(UsageError, CheckpointError):
    """An empty ``--model`` (or model spec): a usage error (exit status 2) that callers catching
    ``CheckpointError`` still see."""


class InvalidRequestError(UsageError):
    """A request the client must change; ``param`` names the offending field (OpenAI's error ``param``).

    Args:
        message: what is wrong, naming the field and the value.
        param: the request field, e.g. ``"n"``, ``"logit_bias"``, ``"stop_token_ids"``, ``"prompt"``.
        fix: what to send instead (appended to the message).
    """

    def __init__(self, message: str = "", *args: object, param: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, *args, fix=fix)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine cannot go on (broken KV bookkeeping, every step failing); the cause is chained.

    Defined here, apart from the engine, so a server can catch it without importing torch."""
