"""Whether a DiLoCo checkpoint resumes at another number of sites (parallel.dp_replicate): the
note a checkpoint's manifest carries for it, the rule, and the launcher's check of the run's
newest checkpoint before any worker starts (train/state.py applies the rule to the checkpoint
the workers load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.checkpoint.checkpointer import checkpoint_storage
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.storage import StorageError
from distrain.config.schema import CheckpointConfig, DiLoCoConfig
from distrain.errors import CheckpointError, ConfigError
from distrain.launch.rundir import run_id
from distrain.parallel.mesh import ParallelDims

SITES_SYNCED = "diloco_sites_synced"
"""A DiLoCo checkpoint's manifest note (`DiLoCo.manifest_notes`): every site held the global
weights when it was saved."""


def site_change_problem(manifest: dict[str, Any], sites: int) -> str | None:
    """Why a checkpoint with `manifest` cannot resume at `sites` DiLoCo sites, or None.

    The global weights and the outer momentum are shared by all sites, so they carry over to
    another number of sites; the sites' own weights and inner optimizer states do not, so a
    checkpoint resumes at another number of sites only where every site held the global
    weights (site s then takes saved site s mod their number's inner state, train/state.py)."""
    saved = ParallelDims.sites_in(str(manifest.get("layout", "")))
    notes = manifest.get("notes")
    if saved is None or saved == sites or (isinstance(notes, dict) and notes.get(SITES_SYNCED)):
        return None
    return (
        f"parallel.dp_replicate = {sites}: checkpoint step-{manifest.get('step', 0):08d} was "
        f"saved by {saved} DiLoCo sites between outer steps, where each site's weights "
        f"differ; resume it with parallel.dp_replicate = {saved}, or change the site count at "
        "a checkpoint where every site holds the global weights (diloco.fragments = 1, "
        "diloco.overlap_steps = 0, checkpoint.interval_steps a multiple of diloco.inner_steps)"
    )


def check_resume_sites(
    diloco: DiLoCoConfig, dp_replicate: int, checkpoint: CheckpointConfig, run_dir: str
) -> None:
    """Under DiLoCo, the newest checkpoint of the run in `run_dir` (the one its workers will
    resume) can resume at `dp_replicate` sites (parallel.dp_replicate: `site_change_problem`).
    The workers apply the same rule to the checkpoint they load (checkpoint.resume_from's, or an
    older one when the newest is damaged); a storage that cannot be listed here is theirs to
    report."""
    if diloco.inner_steps == 0 or dp_replicate < 1:
        return
    own = run_id(Path(run_dir), create=False)
    try:
        storage = checkpoint_storage(checkpoint, run_dir)
        entries = [e for e in committed(storage) if e.manifest.get("run_id") == own]
    except (StorageError, CheckpointError):
        return
    if entries:
        problem = site_change_problem(entries[-1].manifest, dp_replicate)
        if problem is not None:
            raise ConfigError(problem)
