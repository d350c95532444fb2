"""The attacks of the network review, end to end: a process using only torchft's public Manager
joins a live replica group's lighthouse as "group1", without the run secret.

- **ahead**: it claims step 1,000,000 and serves, on torchft's default transport, a state that
  unpickles to `touch MARKER`. The live group tries to take that state, refuses it (the
  attacker's manager server is not behind a manager front that proves the run secret), never
  asks for it or unpickles it, and after three refused attempts stops with one line naming the
  refusal;
- **poison**: it joins at the live group's step (its own transport fabricates the heal), to add
  gradients of 1000 and a loss of 0 to every exchange. The live group finds its replica id
  without a proof of the run secret in the quorum and refuses each attempt with it before the
  exchange (nothing of it is averaged, and no attempt waits for it), and stops the same way;
- **kill**: two groups train with the secret; a process without it sends torchft's `Kill` and a
  forged `Quorum` (gRPC) to the manager address group 0 publishes. The manager front refuses the
  connection in one line, both calls fail, and both groups finish the run.

In all, MARKER never exists and every step the group logged is the 1-process run's (within
1e-6, relative): the attacker changed nothing it trained on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import SMALL_RUN, losses, start_train, train_in_process
from replica import (
    metrics_rows,
    reaped,
    running_lighthouse,
    secret_file,
    start_groups,
    trained_step,
    wait_until,
)

from distrain.config.io import load_config
from distrain.ft.trust import SLOT_SIZE
from distrain.layout.rules import validate
from distrain.models.decoder.counts import num_params
from distrain.observe.diagnose import replica_lines
from distrain.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 200
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
GROUP_FIELDS = {
    **FIELDS,
    "parallel__zero_stage": 3,
    "fault_tolerance__replica_groups": 2,
    "fault_tolerance__timeout_s": 5,
    # Group 1 never comes: group 0 starts alone after this wait (the default 120 s is idle time).
    "fault_tolerance__quorum_timeout_s": 15,
    "debug__slow_rank": 0,
    "debug__slow_ms": 200,
}

ATTACKER = """
import os, sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

mode, lighthouse, marker, size, slots = sys.argv[1:6]
size, slots = int(size), int(slots)


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


class Fabricated(HTTPTransport):
    # 'poison' joins at the quorum's step without the live state: it makes one up.
    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        return {"user": {"distrain": {}}, "torchft": {"step": step, "batches_committed": 0}}


timeout = timedelta(seconds=5)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),
    load_state_dict=None,
    state_dict=None,
    min_replica_size=1,
    use_async_quorum=False,
    timeout=timeout,
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=store.port,
    lighthouse_addr=lighthouse,
    replica_id="group1",
    checkpoint_transport=(Fabricated if mode == "poison" else HTTPTransport)(timeout, 0),
    init_sync=False,
)
manager.register_state_dict_fn("distrain", lambda state: None, lambda: {"x": Payload()})
manager.load_state_dict({"step": 1_000_000 if mode == "ahead" else 0, "batches_committed": 0})
while True:
    manager.start_quorum()
    flat = torch.full((size + 1 + slots,), 1000.0)
    flat[size] = 0.0  # the loss it reports
    manager.allreduce(flat).wait()
    manager.should_commit()
"""


@pytest.fixture(scope="module")
def lighthouse():
    with running_lighthouse() as address:
        yield address


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference")
    return losses(train_in_process(run, **FIELDS))


def _attacked(tmp_path, lighthouse: str, mode: str) -> tuple[int, str, list[dict], bool]:
    """Group 0 trains; once it logged step 3 the attacker joins. Returns group 0's exit code,
    stderr and rank log, its metrics rows, and whether the attacker's payload ran."""
    run, marker = tmp_path / "group0", tmp_path / "pwned"
    fields = dict(
        GROUP_FIELDS,
        fault_tolerance__group=0,
        fault_tolerance__lighthouse=lighthouse,
        fault_tolerance__secret_file=secret_file(tmp_path),
    )
    size = num_params(validate(load_config(None, []), 1).model)
    group = start_train(run, "--nproc", "1", "--max-restarts", "0", **fields)
    attacker = None
    try:
        wait_until(lambda: trained_step(run) >= 3, "step 3 of group 0", [group], limit_s=180)
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, mode, lighthouse, str(marker), str(size)]
            + [str(2 * SLOT_SIZE)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, RUST_LOG="error"),
        )
        _, err = group.communicate(timeout=240)
    finally:
        for proc in (group, attacker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    log = (run / "logs" / "rank0.log").read_text()
    return group.returncode, err + log, read_metrics(run / "metrics.jsonl"), marker.exists()


@pytest.mark.parametrize(
    ("mode", "refusal"),
    [
        # Its manager server (torchft's own, the recovery source the lighthouse names) is not
        # behind a manager front that proves the run secret (manager_front.py).
        ("ahead", "is not behind a manager front with this run's secret"),
        # Its replica id in the quorum carries no proof of the run secret: each attempt with
        # it is refused before the exchange.
        ("poison", "(replica id 'group1:"),
    ],
)
def test_an_intruder_without_the_secret_runs_no_code_and_steers_nothing(
    tmp_path, lighthouse, reference, mode, refusal
):
    code, err, rows, pwned = _attacked(tmp_path, lighthouse, mode)
    assert not pwned
    assert code != 0, err[-3000:]
    assert "refused 3 attempts in a row" in err and refusal in err, err[-3000:]
    refused = [r for r in rows if r.get("replica_change") == "refused"]
    assert [r["refusals"] for r in refused] == [1, 2, 3], refused
    assert any(refusal in r["reason"] for r in refused), refused
    assert sum("refused a peer" in line for line in replica_lines(rows)) == 3  # diagnose, status
    trained = losses(rows)
    assert 3 <= len(trained) < STEPS
    for step, loss in trained.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), (step, loss, reference[step])


GRPC_ATTACKER = """
import sys
from urllib.parse import urlsplit

import grpc

target = urlsplit(sys.argv[1]).netloc
# torchft.KillRequest{msg: "pwned"}; torchft.ManagerQuorumRequest{group_rank: 0, step: 5}
for method, request in (("Kill", b"\\n\\x05pwned"), ("Quorum", b"\\x08\\x00\\x10\\x05")):
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(f"/torchft.ManagerService/{method}")(request, timeout=5)
            print(method, "answered")
        except grpc.RpcError as error:
            print(method, error.code().name)
"""


def _published_manager_address(run) -> str:
    """The manager address group `run`'s rank 0 published (to the lighthouse and its store),
    from its rank log."""
    log = (run / "logs" / "rank0.log").read_text()
    return re.search(r"answers only through its front at (\S+)", log).group(1)


KILL_STEPS = 40


def test_a_host_without_the_secret_cannot_end_a_group_through_its_manager_server(
    tmp_path, lighthouse
):
    reference = losses(
        train_in_process(tmp_path / "reference", **{**FIELDS, "training__steps": KILL_STEPS})
    )
    runs = [tmp_path / f"group{g}" for g in range(2)]
    secret = secret_file(tmp_path)
    # Paced (100 ms a step): the attack comes while group 0 trains.
    fields = {**GROUP_FIELDS, "debug__slow_ms": 100, "training__steps": KILL_STEPS}
    procs = start_groups(runs, lighthouse, secret, max_restarts=0, **fields)
    with reaped(procs):
        wait_until(lambda: trained_step(runs[0]) >= 3, "step 3 of group 0", procs, limit_s=240)
        published = _published_manager_address(runs[0])
        attack = subprocess.run(
            [sys.executable, "-c", GRPC_ATTACKER, published],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert attack.stdout.split() == ["Kill", "UNAVAILABLE", "Quorum", "UNAVAILABLE"], attack
        attacked_at = trained_step(runs[0])
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errs[0][-3000:]
    assert attacked_at < KILL_STEPS  # the attack came while group 0 trained
    log = (runs[0] / "logs" / "rank0.log").read_text()
    refusals = [
        line for line in log.splitlines() if "manager front of replica group 0 refused" in line
    ]
    assert len(refusals) == 1, refusals
    for run in runs:
        rows = metrics_rows(run)
        assert not [r for r in rows if r.get("replica_change") in ("lost", "refused")], rows
        trained = losses(rows)
        # Group 1 may have joined late (after quorum_timeout_s), with the live state.
        assert sorted(trained)[-1] == KILL_STEPS
        assert run == runs[1] or len(trained) == KILL_STEPS
        for step, loss in trained.items():
            assert loss == pytest.approx(reference[step], rel=1e-6), (step, loss, reference[step])
