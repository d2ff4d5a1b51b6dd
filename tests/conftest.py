"""Fixtures shared by every test, and the GPU mark: a test marked `gpu` is skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import ROOT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_tests:
            item.add_marker(skip)


LOGS_SHOWN, LOG_LINES_SHOWN = 16, 25
"""How much of a failed test's deployment logs its report shows: the first logs by name, their last lines."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    """A failed test that ran a deployment under its tmp_path shows the end of every process's log (without
    DEBUG lines) in its report: a failure on a CI machine can be read from CI's output alone."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and isinstance(tmp_path, Path):
        for log in sorted(tmp_path.glob("**/logs/*.log"))[:LOGS_SHOWN]:
            lines = [line for line in log.read_text(errors="replace").splitlines() if " DEBUG " not in line]
            report.sections.append((f"log {log.relative_to(tmp_path)}", "\n".join(lines[-LOG_LINES_SHOWN:])))
    return report


@pytest.fixture(scope="session")
def root() -> Path:
    """The checkout (configs/, envs/data/, ...)."""
    return ROOT


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny character-level model, materialised once per session into a temp folder."""
    from mas_async.tiny_model import materialise

    return materialise("builtin:tiny-char", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session", autouse=True)
def fork_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One preloaded fork-server template for the session (`mas_async.launch.fork_template`): every run a
    test launches on this machine forks its fork server from it instead of importing torch again (~10
    CPU-s a run). Until the template has preloaded (its socket appears then), launchers start their own
    servers as usual. A test that needs a new server of its own removes the variable (`monkeypatch`)."""
    from mas_async.launch.fork_template import TEMPLATE_ENV

    path = tmp_path_factory.mktemp("template") / "template.sock"
    log = path.parent / "template.log"
    with log.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mas_async.launch.fork_template", str(path)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    os.environ[TEMPLATE_ENV] = str(path)
    try:
        yield path
        assert proc.poll() is None, f"the fork template died (status {proc.returncode}):\n{log.read_text()}"
    finally:
        os.environ.pop(TEMPLATE_ENV, None)
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def _forget_the_process_gpu():
    """A test that places "this process" on a faked GPU (`devices.use_device`) must not leave later tests
    running their worker threads on it: the placement is process-wide."""
    from mas_async import devices

    yield
    devices._placed = None
