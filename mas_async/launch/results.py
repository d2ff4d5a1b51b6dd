"""`mas-async results RUN_DIR OUT`: a run's evaluation rows and resolved config, as committed artefacts.

A learning figure quoted in README.md or docs/ is read from such a folder: OUT/eval.jsonl holds every
evaluation row of the run (`iteration` and every `eval/...` key of metrics.jsonl as the router wrote it:
the held-out success, per-agent figures and the baselines beside the first evaluation), OUT/config.yaml
the run's resolved config, so anyone can rerun it and compare. tests/unit/framework/test_results_quoted.py
checks the quoted tables against these files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EVAL_PREFIX = "eval/"


class ResultsError(ValueError):
    """A run directory without the files an artefact is made of."""


def evaluation_rows(run_dir: Path) -> list[dict]:
    """Every row of `run_dir`'s metrics.jsonl that holds an evaluation, reduced to `iteration` and its eval keys."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ResultsError(f"{run_dir} holds no metrics.jsonl: not a run directory of `mas-async train`")
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        figures = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
        if figures:
            rows.append({"iteration": row["iteration"], **figures})
    if not rows:
        raise ResultsError(f"{path} holds no evaluation row (eval.every=0?)")
    return rows


def export(run_dir: Path, out: Path) -> list[Path]:
    """Write OUT/eval.jsonl and OUT/config.yaml from `run_dir`; returns their paths."""
    run_dir, out = Path(run_dir), Path(out)
    rows = evaluation_rows(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ResultsError(f"{run_dir} holds no config.yaml (the run's resolved config)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.jsonl").write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    shutil.copyfile(config, out / "config.yaml")
    return [out / "eval.jsonl", out / "config.yaml"]
