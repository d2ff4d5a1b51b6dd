"""A user's own inference backend, named by "module:Class" in the config: the config accepts it, the
server's factory builds it (a synchronous engine behind a thread), and an unknown name is a sentence."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mas_async.config import ConfigError, load_config
from mas_async.inference.backends.base import ThreadedBackend, make_backend
from mas_async.inference.request import GenerationRequest
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT

PATH = "tests.unit.framework.test_backend_plugin:EchoEngine"


class EchoEngine:
    """Answers every request with its own last prompt token, n times (a toy engine)."""

    def __init__(self, model_path, *, dtype, max_batch_sequences, seed) -> None:
        self.model_path, self.dtype, self.version = model_path, dtype, 0

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        out = []
        for r in requests:
            token = np.array([r.prompt_ids[-1]], dtype=np.int32)
            out.append([Completion(token, np.zeros(1, dtype=np.float32), self.version, "stop")] * r.n)
        return out


def test_a_backend_named_by_path_is_accepted_and_built(tmp_path):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"policies.vertical.backend={PATH}"])
    spec = config.policies["vertical"]
    backend = make_backend(spec.backend, str(tmp_path), dtype=spec.dtype, max_batch_sequences=4, seed=0)
    assert isinstance(backend, ThreadedBackend) and isinstance(backend.engine, EchoEngine)
    results = asyncio.run(backend.generate([GenerationRequest(np.array([3, 9], dtype=np.int32), n=2)]))
    assert [list(c.token_ids) for c in results[0]] == [[9], [9]] and results[0][0].version == 0


def test_an_unknown_backend_name_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="known backends are hf, mock, vllm"):
        load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=vllmm"])
