"""What a run imports by name is imported before anything starts: a misspelled workflow program, node, env or
backend path is refused by `train --dry-run` (and `train`) with a sentence that names the key and the error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.loadable import check_loadable
from tests.support.paths import ROOT

PROGRAM = "configs/examples/openai_movers.yaml"


def test_the_dry_run_refuses_a_misspelled_program_path_with_a_non_zero_exit():
    proc = subprocess.run(
        [sys.executable, "-m", "mas_async", "train", PROGRAM, "--dry-run", "workflow.program=solver_checker:plax"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "workflow.program 'solver_checker:plax' cannot be loaded" in out, out
    assert "ModuleNotFoundError" in out and "No module named 'solver_checker'" in out, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize(
    ("config", "override", "key"),
    [
        (PROGRAM, "workflow.program=nodes.plan_path:plax", "workflow.program"),
        ("configs/plan_path_tiny.yaml", "agents.vertical.node=nodes.plan_path:Vertical", "agents.vertical.node"),
        ("configs/plan_path_tiny.yaml", "env.name=envs.plan_pth:PlanPathEnv", "env.name"),
        ("configs/plan_path_tiny.yaml", "workflow.name=nodes.plan_path:Nope", "workflow.name"),
        ("configs/plan_path_tiny.yaml", "policies.vertical.backend=my_engines:Fast", "policies.vertical.backend"),
    ],
)
def test_every_name_the_run_imports_is_checked(config, override, key):
    with pytest.raises(ConfigError, match=rf"^{key} .* cannot be loaded"):
        check_loadable(load_config(ROOT / config, [override]))


def test_a_config_whose_names_all_import_passes():
    check_loadable(load_config(ROOT / PROGRAM))
    check_loadable(load_config(ROOT / "configs/plan_path_tiny.yaml"))
