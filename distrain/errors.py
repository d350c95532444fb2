"""Errors a user can fix, and the install hint their messages give for an optional library. The
CLI and the worker entry print these as one line and exit non-zero; anything else is a bug and
keeps its traceback."""


def install_hint(package: str, extra: str) -> str:
    """How to install an optional library: on its own, or through distrain's extra."""
    return (
        f"pip install {package} (or distrain's {extra} extra: "
        f'pip install -e ".[{extra}]" in a checkout)'
    )


class DistrainError(Exception):
    """Base of every user-facing error; the message names the cause and the fix."""

    exit_code: int = 1
    """The process's exit status when this error ends it."""
    label: str = "error"
    """How the one-line message starts: `distrain: <label>: <message>`."""


class ConfigError(DistrainError, ValueError):
    """A config value that cannot be used (a field, its type, or the layout it implies)."""


class MissingInput(ConfigError):
    """A file or folder the config names that is not there: data, a tokenizer, a Hugging Face
    folder. `distrain train --check` says what it could not check for it and checks the rest."""


class CheckpointError(DistrainError):
    """A checkpoint that is missing, incomplete or unreadable."""


class UsageError(ConfigError):
    """A command line the command cannot parse (an unknown option, a value of the wrong type)."""

    exit_code = 2
