"""Fixtures shared by every test, and the GPU mark: a test marked `gpu` is skipped without CUDA."""

from __future__ import annotations

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
