"""`bench/ranks_learning.py`'s reading of runs: the first and last tenth of the evaluations, and the
worst version mismatch and log-prob difference of each policy over a run (the runs themselves are
`mas-async train` runs, tested elsewhere)."""

from __future__ import annotations

import json

import pytest

from bench.ranks_learning import tenth, worst


def test_tenths_and_the_worst_checks_of_a_run(tmp_path):
    assert tenth({"success": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0]}, last=False) == 0.0
    assert tenth({"success": [0.0] * 19 + [0.5, 1.0]}, last=True) == pytest.approx(0.75)
    assert tenth({"success": [0.2, 0.4]}, last=True) == 0.4  # at least one evaluation
    rows = []
    for i, (mismatch, diff) in enumerate([(0, 1e-7), (2, 5e-8), (0, 3e-7)]):
        row = {"iteration": i}
        for policy in ("vertical", "horizontal"):
            row |= {f"policy/{policy}/version_mismatch": mismatch, f"policy/{policy}/logprob_abs_diff": diff,
                    f"policy/{policy}/logprob_abs_diff_max": 10 * diff}  # fmt: skip
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [*rows, {"iteration": 3}]))
    got = worst(tmp_path)
    assert got["vertical/version_mismatch"] == 2 and got["horizontal/logprob_abs_diff"] == 3e-7
    assert got["vertical/logprob_abs_diff_max"] == pytest.approx(3e-6)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 0}))
    with pytest.raises(SystemExit, match="no policy/vertical/version_mismatch"):
        worst(tmp_path)
