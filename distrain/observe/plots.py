"""`distrain plot RUN_DIR ...`: one PNG with a panel per curve (loss, val loss, lr, grad norm,
tokens/s) against the step, the runs overlaid with the run dir's name as legend. Reads
metrics.jsonl through `read_metrics`, so a restarted run is one curve. Draws with Agg only
(no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from distrain.errors import DistrainError
from distrain.files import write_atomic
from distrain.observe.metrics import read_metrics

PANELS = (
    ("loss", "loss"),
    ("val_loss", "val loss"),
    ("lr", "lr"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
)


def _load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DistrainError(f"{run_dir}: no metrics.jsonl here; give a distrain run directory")
    return read_metrics(path)


def plot_runs(run_dirs: list[Path]) -> Figure:
    """A figure with one panel per curve in PANELS and one line per run that logged it."""
    runs = [(Path(d), _load(Path(d))) for d in run_dirs]
    fig = Figure(figsize=(8, 2.4 * len(PANELS)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # renders without a display and without pyplot's global figure list
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        for i, (run_dir, rows) in enumerate(runs):
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(
                    steps,
                    values,
                    color=f"C{i}",
                    label=run_dir.name,
                    marker="." if key == "val_loss" else None,
                )
        if ax.lines:
            ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    return fig


def write_plot(run_dirs: list[Path], out: Path) -> Path:
    """The figure as a PNG at `out`, replacing a symlink there rather than writing through it
    (distrain/files.py: the trackers' copy lives in the run dir)."""
    png = io.BytesIO()
    plot_runs(run_dirs).savefig(png, format="png")
    write_atomic(out, png.getvalue())
    return out
