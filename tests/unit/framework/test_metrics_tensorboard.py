"""MetricsWriter: metrics.jsonl and, beside it, TensorBoard scalars of every numeric value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mas_async.metrics import TENSORBOARD_DIR, MetricsWriter, read_metrics


def test_rows_go_to_jsonl_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.write({"iteration": 0, "team/success_rate": 0.25, "reward/vertical": -1.0, "note": "text"})
    writer.write({"iteration": 1, "team/success_rate": 0.5, "reward/vertical": -0.5, "flag": True})
    writer.close()

    assert [r["iteration"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    events = list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(events) == 1
    board = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    board.Reload()
    scalars = board.Tags()["scalars"]
    assert {"team/success_rate", "reward/vertical", "flag"} <= set(scalars) and "note" not in scalars
    assert [(e.step, e.value) for e in board.Scalars("team/success_rate")] == [(0, 0.25), (1, 0.5)]


def test_tensorboard_can_be_turned_off(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=False)
    writer.write({"iteration": 0, "x": 1.0})
    writer.close()
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_the_writer_does_not_import_torch(tmp_path: Path) -> None:
    """The router writes the metrics: torch would cost it seconds of CPU at every start."""
    code = (
        "import sys; from pathlib import Path; from mas_async.metrics import MetricsWriter; import mas_async.router.hub; "
        f"w = MetricsWriter(Path({str(tmp_path / 'metrics.jsonl')!r})); w.write({{'iteration': 0, 'x': 1.0}}); "
        "w.close(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
