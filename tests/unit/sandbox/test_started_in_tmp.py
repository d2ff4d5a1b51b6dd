"""A process started with `python -m` in a temporary directory (the launcher's children, a bench run from a
test's tmp_path) has that directory on sys.path: its sandbox still starts, and its programs do not see it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mas_async.sandbox import bwrap
from tests.support.paths import ROOT

pytestmark = pytest.mark.skipif(bwrap.unavailable() is not None, reason=str(bwrap.unavailable()))

PROBE = """
import os, sys
from mas_async.sandbox import run_python_sync
here = os.getcwd()
assert here in sys.path, sys.path  # what `python -m` does
result = run_python_sync(f"import os\\nprint(os.path.exists({here!r}), os.path.exists('/tmp'))")
print(result.status, result.stdout.strip(), result.detail)
"""


def test_a_process_started_in_a_temporary_directory_runs_programs_that_cannot_see_it(tmp_path: Path) -> None:
    (tmp_path / "sandbox_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox_probe"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:3] == ["ok", "False", "True"], proc.stdout
