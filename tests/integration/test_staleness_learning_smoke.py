"""`bench/staleness_learning.py --smoke`: two real 2-iteration runs (k = 0 and 1) through `mas-async
train`, their evaluation curves, the summary table and the figure."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import ROOT


def test_staleness_learning_smoke(tmp_path):
    out = tmp_path / "sl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "staleness_learning.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "staleness_learning.json").read_text())
    assert set(result["table"]) == {"0", "1"}
    for k in ("0", "1"):
        (c,) = result["curves"][k]
        assert c["iteration"] == [0, 1, 2] and all(0.0 <= s <= 1.0 for s in c["success"])
        row = result["table"][k]
        assert len(row["final_success"]) == 1 and row["wall_s"][0] > 0
    assert "| 1 |" in proc.stdout and (out / "staleness_learning.png").stat().st_size > 0
