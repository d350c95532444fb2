"""`distrain plot`: the PNG written, its panels, one line per run with the logged values, and the
error for a run dir without metrics."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from distrain.cli import main
from distrain.errors import DistrainError
from distrain.observe.plots import PANELS, plot_runs


def _write_run(run_dir: Path, scale: float) -> dict[str, tuple[list[int], list[float]]]:
    """A metrics.jsonl with train rows every 2 steps and val rows every 4; returns the curves."""
    run_dir.mkdir()
    curves: dict[str, tuple[list[int], list[float]]] = {key: ([], []) for key, _ in PANELS}
    rows = []
    for step in range(2, 13, 2):
        row = {
            "step": step,
            "loss": scale * 10.0 / step,
            "lr": 1e-3 * step / 12,
            "grad_norm": scale + 0.1 * step,
            "tokens_per_s": 1000.0 * scale + step,
        }
        rows.append(row)
        if step % 4 == 0:
            rows.append({"step": step, "val_loss": scale * 11.0 / step})
    for row in rows:
        for key in curves:
            if key in row:
                curves[key][0].append(row["step"])
                curves[key][1].append(row[key])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return curves


def test_plot_overlays_runs_with_their_metrics(tmp_path, capsys):
    expected = {"fsdp": _write_run(tmp_path / "fsdp", 1.0), "tp": _write_run(tmp_path / "tp", 2.0)}
    fig = plot_runs([tmp_path / "fsdp", tmp_path / "tp"])
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["loss", "val loss", "lr", "grad norm", "tokens/s"]
    for ax, (key, _) in zip(axes, PANELS, strict=True):
        assert [line.get_label() for line in ax.lines] == ["fsdp", "tp"]
        for line in ax.lines:
            steps, values = expected[line.get_label()][key]
            assert list(line.get_xdata()) == steps
            assert list(line.get_ydata()) == values

    out = tmp_path / "runs.png"
    assert main(["plot", str(tmp_path / "fsdp"), str(tmp_path / "tp"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.stat().st_size > 0
    width, height = fig.get_size_inches() * fig.dpi
    assert matplotlib.image.imread(out).shape[:2] == (round(height), round(width))


def test_plot_names_the_run_dir_without_metrics(tmp_path, capsys):
    _write_run(tmp_path / "good", 1.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DistrainError, match="empty: no metrics.jsonl here"):
        plot_runs([tmp_path / "good", tmp_path / "empty"])
    assert main(["plot", str(tmp_path / "good"), str(tmp_path / "empty")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'empty'}: no metrics.jsonl here" in err[0]


def test_plot_draws_one_curve_across_a_restart(tmp_path):
    """Rows an attempt logged after the step the next one resumed from are not drawn."""
    run_dir = tmp_path / "restarted"
    run_dir.mkdir()
    rows = [
        {"step": 2, "loss": 4.0},
        {"step": 4, "loss": 3.0},
        {"step": 6, "loss": 99.0},
        {"step": 4, "resumed_from": 4, "attempt": 1},
        {"step": 6, "loss": 2.0, "attempt": 1},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (loss_line,) = plot_runs([run_dir]).get_axes()[0].lines
    assert list(loss_line.get_xdata()) == [2, 4, 6]
    assert list(loss_line.get_ydata()) == [4.0, 3.0, 2.0]
