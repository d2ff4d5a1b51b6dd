"""metrics.wandb: the metrics writer's W&B run, offline (no network), read back from the run file W&B wrote.

The real run through the CLI is tests/integration/test_wandb_e2e.py; these drive the writer directly.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mas_async.config import load_config
from mas_async.metrics import MetricsWriter, read_metrics
from mas_async.wandb_run import RUN_ID_FILE, WANDB_DIR, WandbError, WandbRun
from tests.support.paths import ROOT
from tests.support.wandb_records import read_run

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")

ROWS = [
    {"iteration": 0, "team/success_rate": 0.25, "reward/vertical": -1.0, "policy/v/logprob_abs_diff": 1.3e-08},
    {"iteration": 1, "team/success_rate": 0.5, "eval/team_success_rate": float("nan"), "flag": True, "note": "x"},
]


@pytest.fixture
def wandb_teardown():
    """wandb.init starts a `wandb-core` service process that outlives the run: end it after the test."""
    yield
    import wandb

    wandb.teardown()


def _config(*overrides: str):
    return load_config(ROOT / "configs/plan_path_tiny.yaml", ["metrics.wandb.mode=offline", *overrides])


def _same(a: object, b: object) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_every_row_goes_to_the_offline_run_with_the_same_keys_and_values(tmp_path: Path, wandb_teardown) -> None:
    config = _config("metrics.wandb.tags=[ablation, seed0]", "metrics.wandb.group=g")
    run_dir = tmp_path / "20261203-101500"
    run_dir.mkdir()
    writer = MetricsWriter(
        run_dir / "metrics.jsonl", tensorboard=False, wandb=WandbRun(config.metrics.wandb, config, run_dir)
    )
    for row in ROWS:
        writer.write(row)
    writer.close()

    folders = list((run_dir / WANDB_DIR).glob("offline-run-*"))
    assert len(folders) == 1
    run_id = (run_dir / WANDB_DIR / RUN_ID_FILE).read_text().strip()
    logged = read_run(folders[0] / f"run-{run_id}.wandb")
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    assert [set(row) for row in logged["history"]] == [set(row) for row in jsonl]
    for got, want in zip(logged["history"], jsonl, strict=True):
        assert all(_same(got[key], want[key]) for key in want), (got, want)
    assert logged["run"].display_name == "plan_path_tiny-20261203-101500"
    assert list(logged["run"].tags) == ["ablation", "seed0"] and logged["run"].run_group == "g"
    assert logged["run"].project == "mas-async" and logged["run"].job_type == "train"
    assert logged["config"]["algorithm"] == config.algorithm.model_dump(mode="json")
    assert logged["config"]["metrics"]["wandb"]["mode"] == "offline"


def test_a_restarted_router_logs_to_the_same_wandb_run(tmp_path: Path, wandb_teardown) -> None:
    """A lost router restarts the run in the same directory: the new process continues the W&B run's id."""
    config = _config("metrics.wandb.name=mine")
    for iteration in (0, 1):
        # W&B names a run's folder by the second it started in, plus the id: two starts within one second would
        # share a folder, which a real restart (a lost process found, the run started again) never does.
        time.sleep(1.0 - time.time() % 1.0)
        run = WandbRun(config.metrics.wandb, config, tmp_path)
        run.log({"iteration": iteration, "x": float(iteration)})
        run.finish()
    run_id = (tmp_path / WANDB_DIR / RUN_ID_FILE).read_text().strip()
    files = sorted((tmp_path / WANDB_DIR).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2 and all(read_run(f)["run"].display_name == "mine" for f in files)
    history = [row for f in files for row in read_run(f)["history"]]
    assert sorted(row["iteration"] for row in history) == [0, 1]


def test_online_without_credentials_says_what_to_do(tmp_path: Path, monkeypatch, wandb_teardown) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no saved W&B login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    config = _config("metrics.wandb.mode=online")
    with pytest.raises(WandbError, match=r"metrics\.wandb: W&B could not start run .*wandb login.*mode=offline"):
        WandbRun(config.metrics.wandb, config, tmp_path)


@pytest.mark.parametrize("wandb_on", [False, True])
def test_the_router_imports_wandb_only_when_a_run_asks_for_it(tmp_path: Path, wandb_on: bool) -> None:
    """`import wandb` costs the router about a second of CPU at every start; a run without W&B never pays it."""
    overrides = ["metrics.wandb.mode=offline"] if wandb_on else []
    code = f"""
import sys
from pathlib import Path
from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router.hub import Router
config = load_config({str(ROOT / "configs/plan_path_tiny.yaml")!r}, {overrides!r} + ["env.train_size=8", "env.test_size=4"])
deployment = Deployment("tcp://127.0.0.1:1", {{"vertical": 1, "horizontal": 1}}, {{"vertical": "", "horizontal": ""}})
router = Router(config, deployment, Path({str(tmp_path)!r}))
router.metrics.close()
print("wandb" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(wandb_on), out.stdout + out.stderr
