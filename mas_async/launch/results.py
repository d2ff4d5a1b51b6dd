"""`mas-async results RUN_DIR OUT`: a run's figures, resolved config and code commit, as committed artefacts.

A figure quoted in README.md or docs/ is read from such a folder:

- OUT/eval.jsonl: every evaluation row of the run (`iteration` and every `eval/...` key of metrics.jsonl as
  the router wrote it: the held-out success, per-agent figures and the baselines beside the first
  evaluation); tests/unit/framework/test_results_quoted.py checks the quoted tables against it.
- OUT/metrics.csv: a few columns of every iteration (`COLUMNS`: the time each part of the iteration took,
  the training and held-out success, the rewards, and per policy the on-policy proof `version_mismatch`,
  `logprob_abs_diff` and its max, the entropy), for the timings and on-policy figures a page quotes.
- OUT/config.yaml: the run's resolved config, so anyone can rerun it and compare.
- OUT/commit.txt: the code's commit as the run recorded it when it started (`code_version`).

Nothing of the machine the run came from goes in: the run directory (`run.output_dir`, `resume`) becomes
null, any other absolute path inside the repository becomes relative to it, and one outside it (a local
model folder, a cgroup) keeps only its last part, after `MACHINE_PATH` (`without_machine_paths`: the
function the benches write their figures through, mas_async/machine_paths.py).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import yaml

from mas_async import machine_paths
from mas_async.launch.code_version import COMMIT_FILE

EVAL_PREFIX = "eval/"
COLUMNS = (
    "iteration",
    "time/elapsed_s",
    "time/rollout_s",
    "time/step_s",
    "time/train_s",
    "time/weight_sync_s",
    "team/success_rate",
    "eval/team_success_rate",
    re.compile(r"reward/[^/]+"),
    re.compile(r"policy/[^/]+/(version_mismatch|logprob_abs_diff|logprob_abs_diff_max|entropy)"),
)
"""The keys of metrics.csv, in this order (a pattern: every key it matches, sorted); a key no row has is
left out, and a row without a key has an empty cell."""
RUN_DIR_KEYS = (("run", "output_dir"), ("resume",))
"""Config keys that name the run's directory on its machine: null in the export."""
MACHINE_PATH = "<machine path>/"
"""What an absolute path's directories become in the export."""
NO_COMMIT = "unknown: the run directory recorded no commit\n"


class ResultsError(ValueError):
    """A run directory without the files an artefact is made of."""


def without_machine_paths(value: Any) -> Any:
    """`value` (a config or a row, any nesting of dicts and lists) with every absolute path relative to the
    repository when inside it, else MACHINE_PATH and the path's last part (`machine_paths.without_machine_paths`)."""
    return machine_paths.without_machine_paths(value, outside=MACHINE_PATH)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ResultsError(f"{run_dir} holds no metrics.jsonl: not a run directory of `mas-async train`")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluation_rows(run_dir: Path) -> list[dict]:
    """Every row of `run_dir`'s metrics.jsonl that holds an evaluation, reduced to `iteration` and its eval keys."""
    rows = []
    for row in _rows(run_dir):
        figures = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
        if figures:
            rows.append(without_machine_paths({"iteration": row["iteration"], **figures}))
    if not rows:
        raise ResultsError(f"{run_dir / 'metrics.jsonl'} holds no evaluation row (eval.every=0?)")
    return rows


def metrics_table(rows: list[dict]) -> str:
    """The CSV text of metrics.csv: `COLUMNS` of every row."""
    present = {key for row in rows for key in row}
    header: list[str] = []
    for column in COLUMNS:
        if isinstance(column, str):
            header += [column] if column in present else []
        else:
            header += sorted(key for key in present if column.fullmatch(key))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(["" if row.get(key) is None else row[key] for key in header])
    return out.getvalue()


def public_config(text: str) -> str:
    """A resolved config.yaml with the run's directory null and no absolute path (`without_machine_paths`)."""
    config = yaml.safe_load(text) or {}
    for keys in RUN_DIR_KEYS:
        section = config
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if isinstance(section, dict) and keys[-1] in section:
            section[keys[-1]] = None
    return yaml.safe_dump(without_machine_paths(config), sort_keys=False)


def export(run_dir: Path, out: Path) -> list[Path]:
    """Write OUT/eval.jsonl, metrics.csv, config.yaml and commit.txt from `run_dir`; returns their paths."""
    run_dir, out = Path(run_dir), Path(out)
    rows = evaluation_rows(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ResultsError(f"{run_dir} holds no config.yaml (the run's resolved config)")
    commit = run_dir / COMMIT_FILE
    out.mkdir(parents=True, exist_ok=True)
    written = {
        "eval.jsonl": "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows),
        "metrics.csv": metrics_table(_rows(run_dir)),
        "config.yaml": public_config(config.read_text()),
        COMMIT_FILE: commit.read_text() if commit.is_file() else NO_COMMIT,
    }
    for name, text in written.items():
        (out / name).write_text(text)
    return [out / name for name in written]
