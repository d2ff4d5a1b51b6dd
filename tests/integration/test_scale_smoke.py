"""The control plane's scale simulator (`bench/scale.py`) in its smoke mode: the real router process
against simulated replicas, env workers and trainer, and figures that come from real measurements."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def _run(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--smoke", "--json", str(out), *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_scale_smoke(tmp_path: Path) -> None:
    stdout, figures = _run(tmp_path, "--plot", str(tmp_path / "scale.png"))
    assert "deployment: 1024 GPUs" in stdout and "requests/s" in stdout
    points = figures["points"]
    assert len(points) == 2
    for point in points:
        # Requests went through the router and were answered within the window, and the router worked for them.
        assert point["requests"] > 0 and point["rps"] > 0
        assert point["router_cpu_s"] > 0 and point["router_cpu_us_per_request"] > 0
        # Added latency is measured per request: end-to-end minus the replica's own service time.
        assert point["added_p99_ms"] >= point["added_p50_ms"] > 0
        assert point["e2e_p50_ms"] > point["service_p50_ms"] > 0
        assert math.isclose(point["service_p50_ms"], figures["service_ms"], rel_tol=0.2)
        # Episodes finished: their groups reached the simulated trainer, which stepped with the count the
        # router said it forwarded.
        assert point["samples_per_s"] > 0 and point["steps"] > 0
        assert point["sample_mismatches"] == 0 and point["errors"] == 0
        assert point["router_rss_mb"] > 0
    # Twice the offered load gives more requests through the router (these loads are far below saturation).
    low, high = sorted(points, key=lambda p: p["offered_rps"])
    assert high["rps"] > 1.3 * low["rps"]
    check = figures["deployment"]
    assert check["rate_rps"] == 1024 * 3000 / (100 * 4)  # the smoke run keeps the checked deployment's knobs
    assert check["router_cores"] > 0 and check["max_gpus_one_core"] > 0
    assert (tmp_path / "scale.png").stat().st_size > 0
