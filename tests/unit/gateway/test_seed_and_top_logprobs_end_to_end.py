"""`seed` and `top_logprobs` on the whole path every generation takes, in one process: the `openai` client ->
the gateway -> the env worker's `generate` -> a `Generate` encoded into frames as the router forwards them
-> a real inference server with the transformers backend on the built-in tiny model -> its
`GenerateResult` frames -> the client. A seeded call gives the same text twice, also when it is batched
with other calls, and `top_logprobs` come back, k per token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.gateway.server import Gateway, Limits
from mas_async.inference.server import InferenceServer
from mas_async.rollout.env_worker import EnvWorker, GenerateError
from mas_async.wire.messages import Message, decode, encode
from tests.support.paths import ROOT
from tests.unit.gateway.fakes import openai_client

MESSAGES = [{"role": "user", "content": "GO"}]


def _linked(tiny_model: Path) -> tuple[EnvWorker, InferenceServer, list[int]]:
    """An env worker and an inference server of policy "vertical" whose messages reach each other as
    frames (encoded, then decoded, as the router forwards them); the size of every batch the backend runs
    is recorded."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["rollout.max_tokens=8", "algorithm.k=4"])
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    deployment = Deployment("tcp://127.0.0.1:1", {}, paths, training=False)
    worker = EnvWorker(config, deployment, 0)
    server = InferenceServer(config, deployment, "vertical", 0)
    delivering: set[asyncio.Task] = set()

    def deliver(to: Any) -> Any:
        def send(msg: Message) -> None:
            task = asyncio.ensure_future(to.on_message(decode(encode(msg))))
            delivering.add(task)
            task.add_done_callback(delivering.discard)

        return send

    worker.send, server.send = deliver(server), deliver(worker)
    batches: list[int] = []
    generate = server.backend.generate

    async def recorded(requests):
        batches.append(len(requests))
        return await generate(requests)

    server.backend.generate = recorded
    return worker, server, batches


def test_a_seeded_call_repeats_through_a_real_inference_server_and_top_logprobs_come_back(tiny_model: Path) -> None:
    worker, server, batches = _linked(tiny_model)

    async def main() -> None:
        gateway = Gateway(
            policy_of={"vertical": "vertical"},
            tokenizers=worker.tokenizers,
            generate=worker.generate,
            limits=Limits.of(worker.cfg),
            generate_errors=(GenerateError,),
        )
        await gateway.start()
        serving = asyncio.create_task(server._batch_loop())
        session = gateway.open(episode_id="train0-1", problem_id="p1", mode="train")
        client = openai_client(gateway, session)
        try:

            def call(**fields: Any):
                return client.chat.completions.create(model="vertical", messages=MESSAGES, **fields)

            seeded = {"n": 2, "seed": 123, "logprobs": True, "top_logprobs": 4}
            alone = await call(**seeded)
            batched, _, other_seed, _ = await asyncio.gather(
                call(**seeded), call(n=3), call(n=2, seed=5), call(logprobs=True, top_logprobs=2)
            )
            texts = [c.message.content for c in alone.choices]
            assert [c.message.content for c in batched.choices] == texts
            assert [c.token_ids for c in batched.choices] == [c.token_ids for c in alone.choices]
            assert texts[0] != texts[1]  # the n choices are drawn with seeds 123 and 124
            assert [c.message.content for c in other_seed.choices] != texts
            assert max(batches) >= 3  # the seeded call shared a batch with the others
            for choice in alone.choices:
                assert len(choice.logprobs.content) == len(choice.token_ids)
                for entry in choice.logprobs.content:
                    top = entry.top_logprobs
                    assert len(top) == 4 and [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
                    if entry.token in [a.token for a in top]:
                        assert entry.logprob == next(a.logprob for a in top if a.token == entry.token)
                    else:
                        assert entry.logprob <= top[-1].logprob
            # The legacy route alike: the same text twice, and logprobs=3 alternatives per token.
            first = await client.completions.create(model="vertical", prompt="GO L", seed=9, logprobs=3)
            again = await client.completions.create(model="vertical", prompt="GO L", seed=9, logprobs=3)
            assert first.choices[0].text == again.choices[0].text
            assert first.choices[0].logprobs.top_logprobs == again.choices[0].logprobs.top_logprobs
            assert all(len(d) in (3, 4) for d in first.choices[0].logprobs.top_logprobs)
            # What the episode records is the sampled tokens' log-probs, exactly as sent.
            recorded = session.calls[0].completion
            assert np.allclose(recorded.logprobs, [t.logprob for t in alone.choices[0].logprobs.content])
        finally:
            await client.close()
            serving.cancel()
            await gateway.stop()

    asyncio.run(main())
