"""A small multi-host network on this machine, built from Linux network namespaces, for tests and
benchmarks that need "nodes" joined by a real, shaped link rather than loopback.

`net_lab(num_hosts, rate, delay_ms)` makes one namespace per host (`dtlab-<id>-h<i>`), each with
loopback up and one interface `lab0` holding an address of a private /24 chosen for the lab
(10.213.x.0/24, which exists only inside these namespaces). Two hosts are joined by a veth pair;
more go through a bridge in a namespace of its own (`dtlab-<id>-br`). Every host's egress on
`lab0` is shaped by a token bucket (`tc ... tbf rate <rate>`), with a netem delay under it when
`delay_ms` > 0 (needs the kernel's sch_netem; `lab_available(delay=True)` says whether it is there).

Processes started by `NetLab.run(i, argv)` run inside host i's namespace with a UTS namespace of
their own whose hostname is the host's name, and with /etc/hosts naming every lab host (through
`ip netns exec`'s /etc/netns/<ns>/ convention). So `socket.getfqdn()` gives a name that resolves to
the host's lab address, as on a real cluster: torchrun's c10d rendezvous advertises that name as
the workers' MASTER_ADDR, and gloo is pointed at `lab0` by GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME.

On exit (also on error) every process still running in the lab's namespaces is killed, and the
namespaces (with their links) and /etc/netns entries are deleted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

IFNAME = "lab0"
NETNS_ETC = Path("/etc/netns")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
# tbf: queue at most this much delay before dropping; a TCP sender backs off long before.
_TBF_LATENCY_MS = 50


class LabError(RuntimeError):
    """A lab command failed; the message names the command and its stderr."""


def _sh(*argv: str) -> str:
    """Run a setup command; raise LabError with its stderr when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


def parse_rate(rate: str) -> int:
    """tc's rate syntax (decimal units: "100mbit", "1gbit", "500kbit", "64bit") -> bits/s."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r}: expected a number and bit, kbit, mbit or gbit")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def _shape(ns: str, rate: str, delay_ms: float) -> None:
    """Token bucket on `ns`'s lab0 egress (burst: 4 ms of the rate, at least 64 KiB so a GSO
    super-packet fits), with netem delay as its child when delay_ms > 0."""
    burst = max(parse_rate(rate) // 8 // 250, 64 * 1024)
    tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME)
    _sh(
        *tc,
        *("root", "handle", "1:", "tbf", "rate", rate),
        *("burst", str(burst), "latency", f"{_TBF_LATENCY_MS}ms"),
    )
    if delay_ms > 0:
        _sh(*tc, "parent", "1:1", "handle", "10:", "netem", "delay", f"{delay_ms}ms")


@functools.cache
def lab_available(delay: bool = False) -> str | None:
    """None when a lab can be built here (with netem delay if `delay`), else why not: needs root,
    `ip`, `tc` and `unshare`, and a throwaway namespace with a shaped veth pair must work."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs {', '.join(missing)} (iproute2, util-linux)"
    ns = f"dtlab-{uuid.uuid4().hex[:8]}-probe"
    try:
        _sh("ip", "netns", "add", ns)
    except LabError as e:
        return f"no network namespaces here: {e}"
    try:
        _sh("ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", "peer0")
        _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
        _shape(ns, "1gbit", 1 if delay else 0)
    except LabError as e:
        return f"cannot build a shaped link here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return None


@dataclass(frozen=True)
class LabHost:
    index: int
    ns: str
    """Network namespace name; also the host's hostname inside the lab."""
    addr: str
    """IPv4 address on lab0."""


@dataclass
class NetLab:
    lab_id: str
    subnet: str
    rate: str
    delay_ms: float
    hosts: list[LabHost] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    """Every namespace created, hosts and bridge, in creation order."""
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus `extra`, with gloo/TensorPipe bound to lab0."""
        return {
            **os.environ,
            **(extra or {}),
            "GLOO_SOCKET_IFNAME": IFNAME,
            "TP_SOCKET_IFNAME": IFNAME,
        }

    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: object,
    ) -> subprocess.Popen:
        """Start `argv` inside host i's namespace (hostname = its namespace name); the Popen's
        pid is argv's own process (ip, unshare and sh all exec)."""
        host = self.hosts[i]
        wrapped = [
            *("ip", "netns", "exec", host.ns, "unshare", "--uts", "--"),
            *("sh", "-c", 'hostname "$0" && exec "$@"', host.ns, *argv),
        ]
        proc = subprocess.Popen(wrapped, env=self.env(env), **popen_kwargs)  # type: ignore[arg-type]
        self.processes.append(proc)
        return proc

    def sent_bytes(self, i: int) -> int:
        """Bytes host i has sent on lab0 so far (its root qdisc's counter)."""
        stats = _sh(
            "ip", "netns", "exec", self.hosts[i].ns, "tc", "-s", "qdisc", "show", "dev", IFNAME
        )
        match = re.search(r"Sent (\d+) bytes", stats)
        if match is None:
            raise LabError(f"no byte counter in tc's output: {stats!r}")
        return int(match.group(1))

    def close(self) -> None:
        """Kill what runs in the lab's namespaces, delete them and their /etc/netns entries."""
        for ns in self.namespaces:
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when no other lab (or anything else) uses it


def _build(lab: NetLab, num_hosts: int) -> None:
    net = lab.subnet.rsplit(".", 1)[0]
    for i in range(num_hosts):
        ns = f"dtlab-{lab.lab_id}-h{i}"
        _sh("ip", "netns", "add", ns)
        lab.namespaces.append(ns)
        lab.hosts.append(LabHost(i, ns, f"{net}.{i + 1}"))
    if num_hosts == 2:
        a, b = lab.hosts
        _sh(
            *("ip", "link", "add", IFNAME, "netns", a.ns, "type", "veth"),
            *("peer", "name", IFNAME, "netns", b.ns),
        )
    else:
        bridge = f"dtlab-{lab.lab_id}-br"
        _sh("ip", "netns", "add", bridge)
        lab.namespaces.append(bridge)
        _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for host in lab.hosts:
            port = f"p{host.index}"
            _sh(
                *("ip", "link", "add", IFNAME, "netns", host.ns, "type", "veth"),
                *("peer", "name", port, "netns", bridge),
            )
            _sh("ip", "-n", bridge, "link", "set", port, "master", "br0")
            _sh("ip", "-n", bridge, "link", "set", port, "up")
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.ns}\n" for h in lab.hosts)
    for host in lab.hosts:
        _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        _sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
        _sh("ip", "-n", host.ns, "link", "set", IFNAME, "up")
        _shape(host.ns, lab.rate, lab.delay_ms)
        etc = NETNS_ETC / host.ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)


@contextlib.contextmanager
def net_lab(num_hosts: int = 2, rate: str = "1gbit", delay_ms: float = 0) -> Iterator[NetLab]:
    """Build the lab (see the module docstring), yield it, tear it down whatever happens."""
    if not 2 <= num_hosts <= 250:
        raise ValueError(f"num_hosts must be in [2, 250], got {num_hosts}")
    parse_rate(rate)
    lab_id = uuid.uuid4().hex[:8]
    lab = NetLab(lab_id, f"10.213.{int(lab_id, 16) % 256}.0/24", rate, delay_ms)
    try:
        _build(lab, num_hosts)
        yield lab
    finally:
        lab.close()
