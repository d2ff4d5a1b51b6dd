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
