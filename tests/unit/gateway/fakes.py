"""A live gateway for the gateway's tests: fake inference that records every request; `serve`, which
runs a test against a started gateway with one open session and always stops it; and `play_program`, which
plays one episode of a workflow program through a started gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np

from envs.plan_path import PlanPathEnv
from mas_async.gateway.episode import GatewayEpisode
from mas_async.gateway.server import Gateway, Limits
from mas_async.gateway.session import Session
from mas_async.gateway.workflow import ProgramWorkflow
from mas_async.tiny_model import IM_END_ID, build_tokenizer
from mas_async.wire.samples import Completion

LIMITS = Limits(max_n=4, max_tokens=8, temperature=1.0, eval_greedy=True, max_calls=5, max_request_bytes=64 * 1024)
POLICY_OF = {"vertical": "pv", "horizontal": "ph"}


class InferenceDown(RuntimeError):
    pass


class FakeInference:
    """Answers every request with the reply `text` (+ <|im_end|>) at weight version 7, and records it. A
    request for k alternatives gets, at each position, the sampled id and the k - 1 ids after it, with the
    sampled token's log-prob and then one less each (`alternatives`)."""

    def __init__(self, tokenizer: Any, text: str = "UD") -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.requests: list[dict[str, Any]] = []
        self.fail: str | None = None
        self.delay_s = 0.0
        """How long a request takes (so that concurrent requests interleave)."""
        self.during: Callable[[], None] | None = None
        """Called while a request is being served (e.g. to end the episode meanwhile)."""

    async def __call__(
        self, policy, prompt_ids, n, greedy, *, max_tokens, temperature, seed=None, top_logprobs=0
    ) -> list[Completion]:
        self.requests.append(
            {"policy": policy, "prompt_ids": prompt_ids.tolist(), "n": n, "greedy": greedy,
             "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "top_logprobs": top_logprobs}
        )  # fmt: skip
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise InferenceDown(self.fail)
        if self.during is not None:
            self.during()
        ids = np.asarray(self.reply_ids(), dtype=np.int32)
        logprobs = -np.linspace(0.1, 0.5, len(ids)).astype(np.float32)
        top = alternatives(ids, logprobs, top_logprobs) if top_logprobs else (None, None)
        return [Completion(ids, logprobs, 7, "stop", *top) for _ in range(n)]

    def reply_ids(self) -> list[int]:
        return [*self.tokenizer.encode(self.text, add_special_tokens=False), IM_END_ID]


def alternatives(ids: np.ndarray, logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake's k alternatives of each position: the sampled id and the k - 1 ids after it, with log-probs
    from the sampled token's down by 1 each."""
    return (ids[:, None] + np.arange(k)).astype(np.int32), (logprobs[:, None] - np.arange(k)).astype(np.float32)


def gateway_of(fake: FakeInference, limits: Limits = LIMITS) -> Gateway:
    """A gateway (not started) of the two agents, both policies with the fake's tokenizer and inference."""
    return Gateway(
        policy_of=POLICY_OF,
        tokenizers={"pv": fake.tokenizer, "ph": fake.tokenizer},
        generate=fake,
        limits=limits,
        generate_errors=(InferenceDown,),
    )


Test = Callable[[Gateway, Session, FakeInference, httpx.AsyncClient], Awaitable[None]]


def serve(test: Test, *, mode: str = "train", text: str = "UD", tokenizer: Any = None, limits: Limits = LIMITS) -> None:
    """Run `test` against a started gateway with one open session, then stop the gateway."""
    tokenizer = tokenizer or build_tokenizer()

    async def main() -> None:
        fake = FakeInference(tokenizer, text)
        gateway = gateway_of(fake, limits)
        await gateway.start()
        session = gateway.open(episode_id="train0-1", problem_id="p1", mode=mode)
        try:
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10.0) as http:
                await asyncio.wait_for(test(gateway, session, fake, http), 60)
        finally:
            await gateway.stop()

    asyncio.run(main())


def openai_client(gateway: Gateway, session: Session) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0, timeout=10.0)


def auth(session: Session) -> dict[str, str]:
    return {"Authorization": f"Bearer {session.key}"}


def chat(content: str = "GO", **fields: Any) -> dict[str, Any]:
    return {"model": "vertical", "messages": [{"role": "user", "content": content}], **fields}


def refused(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of `response`, checked to be one, with `status`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def plan_path_env() -> PlanPathEnv:
    """A Plan-Path env reset to the first size-4 training problem."""
    env = PlanPathEnv()
    env.reset(options={"problem": PlanPathEnv.problems("train", 1, sizes=[4])[0]})
    return env


def play_program(
    program: Any, fake: FakeInference, *, limits: Limits, mode: str = "train", options: Any = None, scorer: Any = None
) -> GatewayEpisode:
    """Play one episode (train0-3 of problem p9, a size-4 Plan-Path problem) of `program` through a started
    gateway answered by `fake`; with `scorer`, the gateway's tree scorer is replaced by it. Bounded (60 s);
    the gateway is stopped whatever happens, after checking the episode's session was closed."""
    env = plan_path_env()

    async def main() -> GatewayEpisode:
        gateway = gateway_of(fake, limits)
        if scorer is not None:
            gateway.scorer = scorer  # (the gateway loaded the tree's own; the test's records its calls)
        await gateway.start()
        episode = GatewayEpisode(
            gateway=gateway,
            episode_id="train0-3",
            problem_id="p9",
            problem={},
            env=env,
            policy_of=POLICY_OF,
            alpha=2.0,
            mode=mode,
            client_timeout_s=10.0,
        )
        try:
            await asyncio.wait_for(ProgramWorkflow(program, options or {}).run(episode), 60)
        finally:
            assert gateway.sessions.open == {}, "the episode's session is closed whatever happens"
            await gateway.stop()
        return episode

    return asyncio.run(main())
