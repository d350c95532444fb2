"""The network lab (tests/netlab.py): its links are shaped as asked, and a 2-"node" distrain run
across it (one torchrun agent per namespace, rendezvous on host 0's lab address) trains exactly
like the same run on loopback. Skipped, with the reason, where namespaces or tc are unavailable
(netem for the delay test); a failure instead where DISTRAIN_REQUIRE names netlab (netem)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from batch import Run, pool_name
from helpers import losses, overrides
from netlab import lab_available, net_lab, parse_rate

from distrain.observe.metrics import read_metrics

PORT = 29500  # nothing else lives in the lab's namespaces

# Receives until EOF on the lab address, answers with the byte count: argv addr port.
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
conn.sendall(str(total).encode())
"""

# Client prologue: connect to argv addr port, waiting (at most 5 s) for the server to start.
CONNECT = """
import json, socket, statistics, sys, time
deadline = time.monotonic() + 5
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
"""

# Connects, sends argv[3] bytes, prints JSON timings.
SOURCE = (
    CONNECT
    + """payload = b"x" * int(sys.argv[3])
start = time.perf_counter()
conn.sendall(payload)
conn.shutdown(socket.SHUT_WR)
received = int(conn.recv(64))
print(json.dumps({"seconds": time.perf_counter() - start, "received": received}))
"""
)

# Round trips of one byte over TCP (an echo): argv addr port, prints the median in seconds.
ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while byte := conn.recv(1):
    conn.sendall(byte)
"""
PING = (
    CONNECT
    + """conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(7):
    start = time.perf_counter()
    conn.sendall(b"p")
    conn.recv(1)
    rtts.append(time.perf_counter() - start)
print(statistics.median(rtts))
"""
)


def _require_lab(delay: bool = False) -> None:
    reason = lab_available(delay)
    if reason is not None:
        pytest.skip(reason)


def _pair(lab, server: str, client: str, *args: str) -> str:
    """Run `server` on host 1 and `client` on host 0 (both given host 1's address and PORT plus
    `args`); return the client's stdout."""
    where = (lab.hosts[1].addr, str(PORT))
    sink = lab.run(1, [sys.executable, "-c", server, *where], stderr=subprocess.PIPE, text=True)
    source = lab.run(
        0,
        [sys.executable, "-c", client, *where, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = source.communicate(timeout=30)
    assert source.returncode == 0, err
    _, err = sink.communicate(timeout=10)
    assert sink.returncode == 0, err
    return out


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_lab_link_is_limited_to_its_rate():
    _require_lab()
    rate, size = "40mbit", 6_000_000  # 1.2 s at the rate
    with net_lab(2, rate=rate) as lab:
        result = json.loads(_pair(lab, SINK, SOURCE, str(size)))
    assert result["received"] == size
    measured = size * 8 / result["seconds"]
    # Below: TCP's ramp-up and the shared CPUs; above: only tbf's initial burst (4 ms of rate).
    assert 0.6 * parse_rate(rate) <= measured <= 1.1 * parse_rate(rate), measured


@pytest.mark.slow
@pytest.mark.requires("netem")
def test_lab_link_adds_its_delay():
    _require_lab(delay=True)
    delay_ms = 20
    with net_lab(2, rate="1gbit", delay_ms=delay_ms) as lab:
        rtt = float(_pair(lab, ECHO, PING))
    # Both hosts delay their egress: one round trip crosses the link twice.
    assert 2 * delay_ms / 1e3 * 0.9 <= rtt <= 2 * delay_ms / 1e3 + 0.05, rtt


FIELDS = {
    "training__steps": 6,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 4,
    "training__seq_len": 64,
    "optim__warmup_steps": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


TWO_NODES = "test_two_node_run_over_the_lab_equals_loopback"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The loopback run, where the two-node test is selected (tests/batch.py's pool: it shares
    the session's 2-rank torchrun launch; where the lab is missing it runs for nothing)."""
    return {f"{TWO_NODES}:loopback": Run(2, FIELDS)} if TWO_NODES in names else {}


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_two_node_run_over_the_lab_equals_loopback(tmp_path: Path, batch_pool):
    _require_lab()
    loopback = batch_pool.trained(pool_name(__name__, f"{TWO_NODES}:loopback"))
    run = tmp_path / "lab"
    with net_lab(2, rate="1gbit") as lab:
        endpoint = f"{lab.hosts[0].addr}:{PORT}"
        agents = []
        for node in (0, 1):
            argv = [sys.executable, "-m", "distrain", "train", "--nnodes", "2", "--nproc", "1"]
            argv += ["--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", "lab"]
            for key, value in overrides(run, **FIELDS):
                argv += [f"--{key}", value]
            agents.append(
                lab.run(
                    node,
                    argv,
                    env={"PYTHONUNBUFFERED": "1"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for agent in agents:
            _, stderr = agent.communicate(timeout=180)
            assert agent.returncode == 0, stderr[-3000:]
        # The gradients crossed the shaped link: 6 all-reduces of 3.4 MB (tiny's fp32 gradients).
        sent = [lab.sent_bytes(i) for i in (0, 1)]
        assert min(sent) > FIELDS["training__steps"] * 3_000_000, sent
    want = losses(read_metrics(loopback / "metrics.jsonl"))
    got = losses(read_metrics(run / "metrics.jsonl"))
    assert got.keys() == want.keys() and len(want) == FIELDS["training__steps"]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got[step], want[step])
