"""The writer process of checkpoint.async_mode = "process" (`WriterProcess`, `OffloadedWriter`):
this rank's checkpoint files are serialized, hashed and written by a process of its own, so the
training process's interpreter does none of that work beside the training step.

Only the bytes move there. DCP's planning, the metadata, the rank records and the commit stay in
the training process's writer thread (checkpointer.py), over its process groups: the child needs
none, and never sees a DTensor or its mesh. For each save the thread resolves its write items to
plain tensors (views of the staged shared-memory copy, which cross the pipe as handles, not
bytes) and serialized objects; the child writes them with the storage's own hashing writer and
returns DCP's write results and the files' sizes and SHA-256. A child that dies (killed, out of
memory) fails that save, like a full disk would, and the next save starts a new one.
"""

from __future__ import annotations

import io
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (shares tensors through pipes as shared memory)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from distrain.checkpoint.storage import HashingWriter, Storage, one_line
from distrain.errors import CheckpointError

_STOP = "stop"


class WriterProcess:
    """One spawned process that writes checkpoint files on request, one request at a time."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_end,), name="distrain-checkpoint-writer", daemon=True
        )
        self.process.start()
        child_end.close()

    def alive(self) -> bool:
        return self.process.is_alive()

    def write(
        self, url: str, retry_s: float, path: str, plan: SavePlan, data: dict[MetadataIndex, Any]
    ) -> tuple[list[WriteResult], dict[str, Any], int, OSError | None]:
        """Write `plan`'s items (`data`: each item's tensor or bytes) under `path` of the storage
        at `url`. Returns DCP's write results, the files' records, the bytes planned and the
        first OSError a write raised; raises what the write raised, or CheckpointError when the
        process died."""
        try:
            self.conn.send((url, retry_s, path, plan, data))
            ok, *reply = self.conn.recv()
        except (EOFError, OSError) as e:
            self.process.join(timeout=5)
            raise CheckpointError(
                f"the checkpoint writer process died (exit code {self.process.exitcode})"
            ) from e
        if not ok:
            error, write_error = reply
            raise _WriteFailed(error, write_error)
        results, written, planned_bytes, write_error = reply
        return results, written, planned_bytes, write_error

    def close(self) -> None:
        """Stop the process (at once if it does not stop by itself)."""
        try:
            self.conn.send(_STOP)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class _WriteFailed(Exception):
    """A write that failed in the writer process: `error` is what it raised there."""

    def __init__(self, error: BaseException, write_error: OSError | None):
        super().__init__(str(error))
        self.error, self.write_error = error, write_error


class OffloadedWriter(StorageWriter):
    """`inner`'s DCP storage writer with its file writing done by `process`: every other step
    (planning, the metadata file) runs here. After a write, `inner` holds the records, the
    bytes planned and the first write error as if it had written the files itself."""

    def __init__(self, inner: HashingWriter, process: WriterProcess, storage: Storage, path: str):
        self.inner, self.process, self.storage, self.path = inner, process, storage, path

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)  # type: ignore[attr-defined]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)  # type: ignore[attr-defined]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.inner.prepare_local_plan(plan)  # type: ignore[attr-defined]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.inner.prepare_global_plan(plans)  # type: ignore[attr-defined]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data = {item.index: planner.resolve_data(item) for item in plan.items}
        try:
            results, written, planned, write_error = self.process.write(
                self.storage.url, self.storage.retry_s, self.path, plan, data
            )
        except _WriteFailed as failed:
            self.inner.write_error = failed.write_error
            raise failed.error from None
        self.inner.written.update(written)
        self.inner.planned_bytes, self.inner.write_error = planned, write_error
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.inner.finish(metadata, results)  # type: ignore[attr-defined]

    def storage_meta(self) -> StorageMeta | None:
        return self.inner.storage_meta()  # type: ignore[attr-defined]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class _GivenData(SavePlanner):
    """The planner the child writes with: each item's data as the training process resolved
    it."""

    def __init__(self, data: dict[MetadataIndex, Any]):
        self.data = data

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self.data[write_item.index]

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise NotImplementedError


def _serve(conn: Connection) -> None:
    """The writer process: write each request's files, reply, until told to stop."""
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the training process is gone
            return
        if request == _STOP:
            return
        url, retry_s, path, plan, data = request
        writer = Storage(url, retry_s=retry_s).dcp_writer(path)
        try:
            results = writer.write_data(plan, _GivenData(data)).wait()  # type: ignore[attr-defined]
        except Exception as e:
            try:
                conn.send((False, e, writer.write_error))
            except Exception:  # an error that does not pickle: its line
                conn.send((False, RuntimeError(one_line(e)), writer.write_error))
            continue
        finally:
            del data  # the staged copy's shared memory is the training process's to reuse
        conn.send((True, results, writer.written, writer.planned_bytes, writer.write_error))
