"""Errors a user can act on, each mapped to a documented exit code.

Expected conditions raise a subclass of :class:`QpeError`; the CLI prints its one-sentence
message (plus an optional hint) and exits with ``exit_code``, never a traceback.
"""

from __future__ import annotations


class ExitCode:
    """Process exit codes (documented in README "Exit codes")."""

    OK = 0
    FAILED = 1  # the engine, a check or an evaluation failed
    USAGE = 2  # bad arguments or bad input: nothing was run
    CHECKPOINT = 3  # stopped at a checkpoint waiting for approval
    VALIDATION = 4  # the quantized model is structurally wrong
    LOCKED = 5  # another run holds the work directory
    INTERRUPTED = 130  # Ctrl-C / SIGTERM


class QpeError(Exception):
    """Base class: an expected failure with a message the user can act on."""

    exit_code = ExitCode.FAILED

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} {self.hint}"


class UsageError(QpeError):
    """Bad arguments or input; nothing has been created, downloaded or run."""

    exit_code = ExitCode.USAGE


class UnknownEntry(UsageError, KeyError):
    """A name no registry row holds (an unknown --engine, --eval-tier, --target ...); also a KeyError."""


class DuplicateEntry(QpeError):
    """Two registry rows under one name: the second registration would silently replace the first."""


class UnsafeInputError(UsageError):
    """Input that is malformed or hostile (a bad safetensors header, a path escaping its dir)."""


class CheckpointPending(QpeError):
    """A gate needs an approval that was not given."""

    exit_code = ExitCode.CHECKPOINT


class ValidationFailed(QpeError):
    exit_code = ExitCode.VALIDATION


class WorkdirLocked(QpeError):
    exit_code = ExitCode.LOCKED


class Interrupted(QpeError):
    exit_code = ExitCode.INTERRUPTED
