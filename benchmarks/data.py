"""Data loading: the wait per step for data, on local shards and on S3 behind a shaped link, and
the loader's peak memory on a small and on a larger-than-memory sharded dataset.

Datasets are generated: shards of `--shard-mb` MB of random uint16 tokens (one random block,
written to every shard; the index holds its real SHA-256), one document per shard.

1. Data wait, local shards: a `DistributedBatchLoader` over the `--local-gb` dataset, a global
   batch of `--batch` sequences of `--seq-len` tokens, each step followed by `--step-ms` of
   simulated compute (a sleep, which leaves the core to the loader's thread as a GPU step
   would). Rounds alternate prefetch 0 (the batch read on the step) and data.prefetch_batches 2;
   the table shows the median, 99th percentile and maximum wait per step after the first.
2. Data wait, S3: the `--s3-mb` dataset uploaded to a local SeaweedFS server (tests/s3.py),
   read through a relay that shapes the link (`--rate-mbit` shared by every connection, and
   `--delay-ms` before each request is passed on: a round trip), into a cache of 4 windows'
   worth of shards. The first step waits for the first window (reported on its own); the
   others should wait for nothing while the next window comes in behind them.
3. Peak RSS: for each of the `--local-gb` and `--big-gb` datasets, a fresh process builds the
   loader and reads `--rss-steps` steps (prefetch 2, no sleep); it reports its peak RSS
   (the largest resident set after any step) minus its resident set just before the loader was
   built (torch and numpy imported). Shards are read with pread, not memory-mapped, so pages
   read do not count as the process's memory.

The link shaping is a Python relay on loopback, not tc: tc needs root on an interface shared
with everything else on the machine. Run from the repository root:

    python3 benchmarks/data.py --big-gb 30       # what docs/design/benchmarks.md reports
    python3 benchmarks/data.py --big-gb 2 --s3-mb 64 --steps 60   # a quick look

The big dataset is deleted afterwards (--keep keeps it). Writes JSON to --out (default
benchmarks/results/data.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import write_json  # noqa: E402

from distrain.config.schema import DataConfig  # noqa: E402
from distrain.data.loader import DistributedBatchLoader  # noqa: E402
from distrain.data.shards import Shard, ShardIndex, shard_name  # noqa: E402
from distrain.data.sources import build_mixture  # noqa: E402

WINDOW = 2


def make_dataset(folder: Path, total_bytes: int, shard_bytes: int) -> Path:
    """A sharded dataset of identical random shards (see the module doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 256, shard_bytes // 2, dtype=np.uint16)
    data = tokens.tobytes()
    sha = hashlib.sha256(data).hexdigest()
    docs_bytes = _npy_bytes(np.array([0, tokens.size], dtype=np.int64))
    docs_sha = hashlib.sha256(docs_bytes).hexdigest()
    count = max(2 * WINDOW, total_bytes // shard_bytes)
    shards = []
    for i in range(count):
        name = shard_name(i)
        path = folder / name
        if not path.is_file() or path.stat().st_size != len(data):
            path.write_bytes(data)
        (folder / f"{name}.docs.npy").write_bytes(docs_bytes)
        shards.append(Shard(name, tokens.size, 1, sha, docs_sha))
    index = ShardIndex("bytes", "bytes", 256, "uint16", None, tokens.size, tuple(shards))
    (folder / "index.json").write_text(index.to_json())
    return folder


def _npy_bytes(array: np.ndarray) -> bytes:
    with tempfile.TemporaryFile() as f:
        np.save(f, array)
        f.seek(0)
        return f.read()


def loader_for(cfg: DataConfig, args: argparse.Namespace, prefetch: int) -> DistributedBatchLoader:
    mixture, _ = build_mixture(cfg, args.seq_len, seed=1)
    return DistributedBatchLoader(
        mixture,
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        dp_rank=0,
        dp_size=1,
        seed=1,
        prefetch_batches=prefetch,
    )


def waits(loader: DistributedBatchLoader, steps: int, step_s: float) -> list[float]:
    out = []
    for _ in range(steps):
        loader.next_batch()
        out.append(loader.take_wait_s())
        time.sleep(step_s)
    loader.close()
    return out


def summary(values: list[float]) -> dict[str, float]:
    rest = sorted(values[1:])
    return {
        "first_s": values[0],
        "median_s": statistics.median(rest),
        "p99_s": rest[min(len(rest) - 1, int(0.99 * len(rest)))],
        "max_s": rest[-1],
    }


class ShapedGateway:
    """A loopback relay to `target`: server-to-client bytes share one token bucket of `rate`
    bytes/s, and each client-to-server chunk (a request) waits `delay` s before it is passed."""

    def __init__(self, target: str, *, rate: float, delay: float):
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target, self.rate, self.delay = (host, int(port)), rate, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._next_free = time.monotonic()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, shaped: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if shaped:
                    with self._lock:
                        start = max(self._next_free, time.monotonic())
                        self._next_free = start + len(data) / self.rate
                    time.sleep(max(0.0, self._next_free - time.monotonic()))
                else:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def local_waits(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, float]]:
    cfg = DataConfig(path=str(folder), shuffle_window_shards=WINDOW)
    per_mode: dict[int, list[float]] = {0: [], 2: []}
    for round_ in range(args.rounds):
        for prefetch in (0, 2) if round_ % 2 == 0 else (2, 0):
            per_mode[prefetch] += waits(loader_for(cfg, args, prefetch), args.steps, args.step_s)
    return {f"prefetch {p}": summary(v) for p, v in per_mode.items()}


def s3_waits(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, float]]:
    import fsspec
    from s3 import _clear_s3fs_cache, client_env, s3_server

    from distrain.checkpoint.storage import Storage

    out = {}
    with s3_server() as server:
        gateway = ShapedGateway(
            server.endpoint_url, rate=args.rate_mbit * 1e6 / 8, delay=args.delay_ms / 1000
        )
        saved = dict(os.environ)
        try:
            os.environ.update(server.child_env(saved))
            fs, _ = fsspec.core.url_to_fs(server.url())
            fs.put(str(folder) + "/", f"{server.bucket}/ds/", recursive=True)
            os.environ.update(client_env(gateway.endpoint_url))
            _clear_s3fs_cache()
            shard = args.shard_mb << 20
            for prefetch in (0, 2):
                cache = Path(tempfile.mkdtemp(prefix="distrain-cache-"))
                cfg = DataConfig(
                    path=server.url("ds"),
                    cache_dir=str(cache),
                    cache_bytes=4 * WINDOW * shard,
                    shuffle_window_shards=WINDOW,
                )
                mixture, _ = build_mixture(
                    cfg,
                    args.seq_len,
                    seed=1,
                    call_for=lambda url: Storage(url, retry_s=30).call,
                )
                loader = DistributedBatchLoader(
                    mixture,
                    global_batch_size=args.batch,
                    micro_batch_size=args.batch,
                    dp_rank=0,
                    dp_size=1,
                    seed=1,
                    prefetch_batches=prefetch,
                )
                out[f"prefetch {prefetch}"] = summary(waits(loader, args.steps, args.step_s))
                mixture.sources[0].store.close()
                shutil.rmtree(cache)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            gateway.close()
    return out


def _rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm: pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(folder: str, steps: int, batch: int, seq_len: int) -> None:
    """(In a fresh process) the loader's peak RSS over `steps` steps, printed as JSON: the
    largest resident set seen after any step, minus the resident set before the loader."""
    base = _rss_bytes()
    ns = argparse.Namespace(batch=batch, seq_len=seq_len)
    loader = loader_for(DataConfig(path=folder, shuffle_window_shards=WINDOW), ns, 2)
    peak = _rss_bytes()
    start = time.perf_counter()
    for _ in range(steps):
        loader.next_batch()
        peak = max(peak, _rss_bytes())
    seconds = time.perf_counter() - start
    loader.close()
    read = steps * batch * (seq_len + 1) * 2
    result = {
        "loader_peak_rss_mb": (peak - base) / 2**20,
        "read_mb": read / 2**20,
        "seconds": seconds,
        "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result))


def rss(folder: Path, args: argparse.Namespace) -> dict[str, float]:
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import data; "
        f"data.rss_child({str(folder)!r}, {args.rss_steps}, {args.batch}, {args.seq_len})"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--local-gb", type=float, default=1.0)
    parser.add_argument("--big-gb", type=float, default=30.0)
    parser.add_argument("--s3-mb", type=int, default=256)
    parser.add_argument("--shard-mb", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--rss-steps", type=int, default=2000)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--work", default=str(REPO / "benchmarks" / "results" / "data-work"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data.json"))
    args = parser.parse_args()
    args.step_s = args.step_ms / 1000
    work = Path(args.work)
    shard = args.shard_mb << 20
    small = make_dataset(work / "small", int(args.local_gb * 2**30), shard)
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "work"}}
    result["local"] = local_waits(args, small)
    result["s3"] = s3_waits(args, make_dataset(work / "s3", args.s3_mb << 20, shard))
    result["rss"] = {f"{args.local_gb:g} GB": rss(small, args)}
    big = make_dataset(work / "big", int(args.big_gb * 2**30), shard)
    try:
        result["rss"][f"{args.big_gb:g} GB"] = rss(big, args)
    finally:
        if not args.keep:
            shutil.rmtree(work)
    print(f"data wait per step ({args.batch} x {args.seq_len} tokens, {args.step_ms:g} ms steps)")
    print(f"{'where':<8}{'mode':<12}{'first':>10}{'median':>10}{'p99':>10}{'max':>10}")
    for where in ("local", "s3"):
        for mode, s in result[where].items():
            print(
                f"{where:<8}{mode:<12}{s['first_s']:>10.4f}{s['median_s']:>10.5f}"
                f"{s['p99_s']:>10.5f}{s['max_s']:>10.5f}"
            )
    print(f"loader peak RSS over {args.rss_steps} steps (prefetch 2)")
    for size, r in result["rss"].items():
        print(f"{size:<10}{r['loader_peak_rss_mb']:>8.1f} MB   read {r['read_mb']:.0f} MB")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
