"""A worker's one-line error, handed to the launcher once: a worker that `distrain train`
started writes its `DistrainError` into the error file torchrun's agent gives it
(TORCHELASTIC_ERROR_FILE, the file torch's own `record` writes) instead of printing it, and the
launcher prints the first rank's line once, with its label and exit status, rather than each
rank's copy among torchrun's lines. A worker started another way (a user's own torchrun, srun)
prints its line as before."""

from __future__ import annotations

import json
import os
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


def report(error: DistrainError) -> bool:
    """Hand `error` to the launcher that started this worker; False when there is none (the
    caller prints it then)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or LAUNCHER_PID_ENV not in os.environ:
        return False
    data = {
        "message": str(error),
        "timestamp": int(time.time()),
        _KEY: {"label": error.label, "exit_code": error.exit_code},
    }
    write_atomic(path, json.dumps(data))
    return True


def reported(failures: dict[int, Any]) -> WorkerError | None:
    """The lowest failed rank's reported error among torchrun's `failures` (rank ->
    ProcessFailure), naming the other ranks that reported another one; None if no rank
    reported one."""
    errors = {}
    for rank, failure in sorted(failures.items()):
        data = failure.error_file_data
        info = data.get(_KEY) if isinstance(data, dict) else None
        if isinstance(info, dict) and isinstance(data.get("message"), str):
            errors[rank] = (data["message"], str(info.get("label", "error")), info.get("exit_code"))
    if not errors:
        return None
    first, (message, label, exit_code) = next(iter(errors.items()))
    others = sorted(r for r, (m, _, _) in errors.items() if m != message)
    if others:
        message += f" (rank {first}; ranks {', '.join(map(str, others))} reported other errors)"
    code = exit_code if isinstance(exit_code, int) and exit_code > 0 else 1
    return WorkerError(message, label=label, exit_code=code)
