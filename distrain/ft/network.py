"""Where the replica groups' lighthouse is, whether the run may span hosts and so needs a run
secret, and reading that secret: decided from the config and the secret file alone, so that the
launcher refuses a bad setting before any worker starts and the workers read it the same way
(ft/trust.py uses the secret)."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path
from urllib.parse import urlsplit

from distrain.errors import ConfigError, MissingInput

MIN_SECRET_BYTES = 16


def lighthouse_host(lighthouse: str) -> tuple[str, int]:
    """(host, port) of a lighthouse address such as http://host:29510."""
    parts = urlsplit(lighthouse if "//" in lighthouse else f"http://{lighthouse}")
    if not parts.hostname or parts.port is None:
        raise ConfigError(
            f"fault_tolerance.lighthouse = {lighthouse!r} is not http://host:port; give the "
            "address `distrain lighthouse` listens on"
        )
    return parts.hostname, parts.port


def is_loopback(host: str) -> bool:
    """`host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secret_needed(lighthouse: str, bind: str = "") -> bool:
    """A run needs a secret when any address its groups listen on or reach is not loopback: the
    lighthouse's (groups may span hosts) or `bind` (fault_tolerance.bind, where each group's
    manager server and live-state server listen; empty = the interface toward the lighthouse,
    loopback exactly when the lighthouse is)."""
    if bind and not is_loopback(bind.strip("[]")):
        return True
    return not is_loopback(lighthouse_host(lighthouse)[0])


def groups_on_this_host(replica_groups: int, lighthouse: str) -> int:
    """The replica groups (each its own torchrun) that share this host: all of
    fault_tolerance.replica_groups where the lighthouse (`lighthouse`, or where empty the
    TORCHFT_LIGHTHOUSE environment variable) is on a loopback address, which only groups on this
    host reach; otherwise 1 (this group: where the others run is not known)."""
    address = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if replica_groups < 2 or not address:
        return 1
    try:
        host, _ = lighthouse_host(address)
    except ConfigError:
        return 1  # refused with its fix before launch (preflight, the workers)
    return replica_groups if is_loopback(host) else 1


def read_secret(path: str, field: str = "fault_tolerance.secret_file") -> bytes:
    """The run secret in `path` (surrounding whitespace stripped), or a one-line ConfigError
    naming `field`: the file must be a regular file (not a link), readable by its owner only, of
    at least MIN_SECRET_BYTES bytes."""
    file = Path(path)
    try:
        info = file.lstat()
    except FileNotFoundError as error:
        raise MissingInput(
            f"{field} = {path!r}: {error.strerror}; create it on every host"
        ) from None
    except OSError as error:
        raise ConfigError(f"{field} = {path!r}: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{field} = {path!r} is not a regular file; give the file itself")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"{field} = {path!r} is readable by others (mode {info.st_mode & 0o777:o}); "
            f"run chmod 600 {path}"
        )
    secret = file.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{field} = {path!r} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; "
            "write a random one, e.g. `openssl rand -hex 32 > FILE`"
        )
    return secret


def secret_missing(lighthouse: str, bind: str = "") -> str:
    """The one-line refusal of a run whose lighthouse or servers may be reached from other hosts
    and that has no run secret."""
    if is_loopback(lighthouse_host(lighthouse)[0]):
        return (
            f"fault_tolerance.bind = {bind!r} is not a loopback address, so every group's manager "
            "and live-state servers answer other hosts: set fault_tolerance.secret_file to a file "
            "holding a random secret (e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`), or "
            "bind = '127.0.0.1'"
        )
    return (
        f"fault_tolerance.lighthouse = {lighthouse!r} is not on a loopback address, so replica "
        "groups may span hosts: set fault_tolerance.secret_file to a file holding the same "
        "random secret on every host (e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)"
    )
