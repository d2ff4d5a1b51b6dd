"""The mock engine: exact token counts, never a stop token, decodable ids, the modelled speed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from mas_async.inference.backends.mock import DEFAULT_VOCAB, MockEngine, MockSpeed, vocab_size
from mas_async.inference.request import GenerationRequest

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def _model_dir(tmp_path: Path, vocab: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return tmp_path


def test_completions_have_max_tokens_and_no_stop_token(tmp_path: Path) -> None:
    engine = MockEngine(_model_dir(tmp_path, 5), seed=0)
    requests = [GenerationRequest(np.arange(3, dtype=np.int32), n=4, max_tokens=50, stop_token_ids=[0, 2])]
    requests.append(GenerationRequest(np.arange(2, dtype=np.int32), n=1, max_tokens=7))
    results = engine.generate(requests)
    assert [len(group) for group in results] == [4, 1]
    for completion in results[0]:
        assert completion.token_ids.dtype == np.int32 and len(completion.token_ids) == 50
        assert set(completion.token_ids.tolist()) <= {1, 3, 4}
        np.testing.assert_allclose(completion.logprobs, np.full(50, -np.log(5)), rtol=1e-6)
        assert completion.finish_reason == "length" and completion.version == 0
    assert len(results[1][0].token_ids) == 7


def test_same_seed_same_tokens(tmp_path: Path) -> None:
    request = [GenerationRequest(np.arange(3, dtype=np.int32), n=2, max_tokens=16)]
    a = MockEngine(_model_dir(tmp_path, 100), seed=7).generate(request)
    b = MockEngine(_model_dir(tmp_path, 100), seed=7).generate(request)
    np.testing.assert_array_equal(a[0][1].token_ids, b[0][1].token_ids)


def test_vocab_size_from_config_or_default(tmp_path: Path) -> None:
    assert vocab_size(_model_dir(tmp_path, 77)) == 77
    assert vocab_size(tmp_path / "missing") == DEFAULT_VOCAB


def test_speed_model_and_batch_limit() -> None:
    speed = MockSpeed(step_s=0.01, token_s=0.001, max_batch_sequences=4)
    # 6 sequences at a limit of 4 run as batches of 4 and 2, each for 3 steps.
    assert speed.batch_seconds(6, 3) == pytest.approx(3 * (0.01 + 4 * 0.001) + 3 * (0.01 + 2 * 0.001))


def test_generate_takes_the_modelled_time(tmp_path: Path) -> None:
    engine = MockEngine(_model_dir(tmp_path, 50), speed=MockSpeed(step_s=0.01))
    start = time.perf_counter()
    engine.generate([GenerationRequest(np.arange(3, dtype=np.int32), n=8, max_tokens=5)])
    assert time.perf_counter() - start >= 0.05


def test_speed_from_environment_round_trips() -> None:
    speed = MockSpeed(step_s=0.0125, token_s=0.0005, max_batch_sequences=64)
    assert MockSpeed.from_env(speed.to_env()) == speed
    assert MockSpeed.from_env({}) == MockSpeed()
    with pytest.raises(ValueError, match="MAS_ASYNC_MOCK_STEP_MS must be a number"):
        MockSpeed.from_env({"MAS_ASYNC_MOCK_STEP_MS": "fast"})


def test_accepts_any_broadcast(tmp_path: Path) -> None:
    engine = MockEngine(_model_dir(tmp_path, 50))
    assert engine.parameter_manifest() is None
    engine.load_weights([])  # nothing to check, nothing to load
