"""`bench/async_vs_lockstep.py --smoke`: mas-async and the lockstep baseline play the same code episodes
(real programs in the sandbox) and the bench prints the speedup of one over the other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def test_async_vs_lockstep_smoke(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "async_vs_lockstep.py"), "--smoke", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "speedup" in proc.stdout
    figures = json.loads(out.read_text())
    ours, lockstep = figures["mas_async"], figures["lockstep"]
    assert isinstance(figures["speedup"], float) and figures["speedup"] > 0
    assert ours["episodes"] == lockstep["episodes"] == 2
    assert ours["turns"] == lockstep["turns"] == 2 * 2  # every episode plays all its turns
    # The same programs reached the sandbox on both sides: the same answers, the same env steps.
    assert figures["same_workload"] and ours["env_steps"] == lockstep["env_steps"] > 0
    assert sum(ours["kinds"].values()) == 2 * 2 * 2 * 2  # episodes x turns x agents x K
    # Lockstep: one batch per turn; mas-async batches whatever is queued (at least one per turn).
    assert lockstep["generate_calls"] == 2 and ours["generate_calls"] >= 2
