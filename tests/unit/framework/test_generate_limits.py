"""The inference server answers a Generate with an out-of-range value with an error naming the field,
and never queues it; a request within the bounds of the run's config and the model is served."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.inference.server import InferenceServer
from mas_async.tiny_model import materialise
from mas_async.wire.messages import Generate, GenerateResult
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))  # 51 ids, 512 positions


@pytest.fixture(scope="module")
def built(model_path):
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["policies.vertical.backend=mock", "policies.vertical.max_batch_sequences=16", "rollout.max_tokens=8"],
    )  # algorithm.k=8
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1}, {"vertical": model_path}, training=False)
    return InferenceServer(config, deployment, "vertical", 0)


@pytest.fixture
def server(built):
    built.sent, built.refused, built._queue = [], 0, []
    built.send = built.sent.append
    return built


def _generate(**values) -> Generate:
    fields = dict(
        request_id=3, policy="vertical", origin="env_worker/0", deadline=1e12, prompt_ids=np.arange(1, 9, dtype=np.int32),
        n=8, max_tokens=8, temperature=1.0, top_p=1.0, greedy=False, stop_token_ids=[0],
    )  # fmt: skip
    return Generate(**{**fields, **values})


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),  # above max(K=8, max_batch_sequences=16)
        ({"n": 10**12}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 9}, "max_tokens"),  # above rollout.max_tokens
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 2.0}, "temperature"),  # above rollout.temperature
        ({"seed": -2}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop_token_ids": ["eos"]}, "stop_token_ids"),
        ({"stop_token_ids": [51]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(51))}, "stop_token_ids"),
        ({"prompt_ids": np.zeros(0, np.int32)}, "prompt_ids"),
        ({"prompt_ids": np.ones(4, np.float32)}, "prompt_ids"),
        ({"prompt_ids": np.ones(510, np.int32)}, "prompt_ids"),  # 510 + 8 > 512 positions
        ({"prompt_ids": np.array([1, 51], np.int32)}, "prompt_ids"),  # past the vocabulary
        ({"prompt_ids": np.array([-1, 2], np.int32)}, "prompt_ids"),
    ],
)
def test_a_request_out_of_range_gets_an_error_naming_the_field(server, values, field):
    asyncio.run(server.on_message(_generate(**values)))
    (reply,) = server.sent
    assert isinstance(reply, GenerateResult) and reply.request_id == 3 and reply.origin == "env_worker/0"
    assert reply.error.startswith(f"Generate.{field}") and reply.completions == []
    assert server._queue == [] and server.refused == 1


def test_a_request_in_range_is_served(server):
    async def scenario():
        await server.on_message(_generate())
        await server.on_message(_generate(request_id=4, n=16, temperature=0.0, greedy=True, seed=0, top_logprobs=20))
        batches = asyncio.create_task(server._batch_loop())
        while len(server.sent) < 2:
            await asyncio.sleep(0.01)
        batches.cancel()

    asyncio.run(scenario())
    assert [(m.request_id, m.error, len(m.completions)) for m in server.sent] == [(3, "", 8), (4, "", 16)]
    assert server.refused == 0
