"""A worker's one-line error, handed to the launcher once: a worker that `distrain train`
started writes its `DistrainError` into the error file torchrun's agent gives it
(TORCHELASTIC_ERROR_FILE, the file torch's own `record` writes) instead of printing it, and the
launcher prints the first rank's line once, with its label and exit status, rather than each
rank's copy among torchrun's lines. A worker started another way (a user's own torchrun, srun)
prints its line as before.

An unexpected error (not a `DistrainError`) is handed over the same way, as one line (its type
and message), its traceback kept in the rank's log (train/worker.py): when several ranks fail
with the same error, the console shows it once, naming them, not a traceback per rank."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from distrain.errors import DistrainError
from distrain.files import write_atomic
from distrain.launch.lifeline import LAUNCHER_PID_ENV

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_KEY = "distrain"


class WorkerError(DistrainError):
    """A worker's `DistrainError`, raised again by the launcher with its label and status."""

    def __init__(self, message: str, *, label: str, exit_code: int):
        super().__init__(message)
        self.label, self.exit_code = label, exit_code


def report(error: DistrainError, *, traceback: bool = False) -> bool:
    """Hand `error` to the launcher that started this worker; False when there is none (the
    caller prints it then). `traceback`: the rank's log holds its traceback."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or LAUNCHER_PID_ENV not in os.environ:
        return False
    data = {
        "message": str(error),
        "timestamp": int(time.time()),
        _KEY: {"label": error.label, "exit_code": error.exit_code, "traceback": traceback},
    }
    write_atomic(path, json.dumps(data))
    return True


def report_unexpected(error: BaseException) -> bool:
    """Hand an unexpected `error` (its traceback already in the rank's log) to the launcher
    that started this worker, as one line; False when there is none (the caller lets the
    traceback print then)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return report(_Unexpected(text), traceback=True)


class _Unexpected(DistrainError):
    label = "error"
    exit_code = 1


def _same(message: str, rank: int) -> str:
    """`message` with this rank's own number put aside ("rank 3 crashes" -> "rank # crashes"),
    so that ranks that say the same of themselves count as one error."""
    return re.sub(rf"\brank {rank}\b", "rank #", message)


def reported(failures: dict[int, Any], *, logs: str = "logs") -> WorkerError | None:
    """The lowest failed rank's reported error among torchrun's `failures` (rank ->
    ProcessFailure), naming the ranks that reported the same one (their own rank numbers aside)
    and those that reported another one, and where the tracebacks are (the rank logs in `logs`)
    of an unexpected error; None if no rank reported one."""
    errors, tracebacks = {}, []
    for rank, failure in sorted(failures.items()):
        data = failure.error_file_data
        info = data.get(_KEY) if isinstance(data, dict) else None
        if isinstance(info, dict) and isinstance(data.get("message"), str):
            errors[rank] = (data["message"], str(info.get("label", "error")), info.get("exit_code"))
            if info.get("traceback"):
                tracebacks.append(rank)
    if not errors:
        return None
    first, (message, label, exit_code) = next(iter(errors.items()))
    alike = [r for r, (m, _, _) in errors.items() if _same(m, r) == _same(message, first)]
    others = sorted(set(errors) - set(alike))
    notes = [f"ranks {', '.join(map(str, alike))}: the same error"] if len(alike) > 1 else []
    if others:
        notes = notes or [f"rank {first}"]
        notes.append(f"ranks {', '.join(map(str, others))} reported other errors")
    if tracebacks:
        notes.append(f"traceback{'s' * (len(tracebacks) > 1)} in {logs}/rank<N>.log")
    if notes:
        message += f" ({'; '.join(notes)})"
    code = exit_code if isinstance(exit_code, int) and exit_code > 0 else 1
    return WorkerError(message, label=label, exit_code=code)
