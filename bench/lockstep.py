"""The turn-synchronous lockstep baseline, and the scripted code workload it is compared on.

`bench/async_vs_lockstep.py` runs one workload twice: by mas-async (router, env worker and inference
server as processes, every episode on its own) and by the pattern of the reference implementation,
which this module provides: every env steps in lockstep, and each turn ONE batched generate call
carries the requests of all episodes. Three pieces, used by both sides so that only the scheduling
differs:

- `ScriptedEngine`: the mock engine (`MockEngine`: the same `generate`, hence the same time model,
  `max_tokens * (step + sequences * token)` seconds per batch) whose completions are real candidate
  programs for the code env instead of random tokens. The tiny model never writes code that parses,
  so without this no program would ever reach the sandbox. A coder candidate is the problem's
  reference solution, a wrong stub, the solution after a sleep (slow), or a program that blocks until
  the harness's per-test alarm (a hang); a tester candidate is a subset of the problem's tests plus
  one test that no program passes, so no episode ends before its last turn. The choice is a pure
  function of the prompt text and the candidate's index: the same prompts get the same programs on
  both sides, whatever the batching. Slow programs sleep rather than compute, so that their run time
  models a machine with cores to spare instead of measuring this one's CPU contention; `BurningScriptedEngine`
  is the variant whose slow programs spin on the CPU for that time instead, and whose would-be hangs are slow
  programs too (nothing waits for the alarm): a wait then costs CPU on every side.
- `TimedCodeEnv`: the code env, recording how long each `astep` (its sandbox runs) took.
- `LockstepBatcher` and `run_lockstep`: one process, one event loop. Episodes run the same `Episode`
  and the same parallel workflow as in an env worker; the batcher holds every generate request until
  each live episode has made one per agent for the turn, then sends them all to the engine as one
  batch. A turn's generation therefore starts only when every env of the previous turn has stepped:
  the slowest sandbox run of any episode sets the pace of all.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from envs import ENVS
from envs.code import CodeEnv
from envs.code_data import load_own
from mas_async.api import resolve
from mas_async.inference.backends.mock import MockEngine
from mas_async.rollout.episode import Episode
from mas_async.wire.samples import Completion
from nodes import NODES, WORKFLOWS
from nodes.code import CODER_SYSTEM, TESTER_SYSTEM
from nodes.parallel import ParallelWorkflow

if TYPE_CHECKING:
    from pathlib import Path

    from mas_async.config import Config
    from mas_async.inference.backends.base import InferenceBackend
    from mas_async.inference.request import GenerationRequest

CODER_MIX = {"correct": 0.45, "wrong": 0.35, "slow": 0.15, "hang": 0.05}
"""Kinds of coder candidates and their probabilities (what makes env steps heterogeneous)."""
SLOW_S = (0.2, 1.0)
"""A slow program sleeps a uniform time in this range (seconds) before defining its function."""
BURN = "import time\n_until = time.perf_counter() + {seconds:.2f}\nwhile time.perf_counter() < _until:\n    pass\n"
"""The burning variant's slow program: it spins on the CPU for as long as the sleep would have taken (wall-clock
seconds, so that it ends well within the harness's per-test alarm however busy the cores are)."""
HANG = "import time\nwhile True:\n    time.sleep(0.05)\n"
"""Blocks until the harness's per-test alarm (CodeEnv.per_test_s, 2 s) ends the run."""
TASK = re.compile(r"TASK: Write the Python function `(\w+)`")


# -- the scripted engine ---------------------------------------------------------------------------


def coder_answer(problem: dict[str, Any], rng: random.Random, burn: bool = False) -> tuple[str, str]:
    """(kind, answer) of one coder candidate: one ```python block, as `nodes.code.Coder` expects. With `burn`
    a slow program spins instead of sleeping, and a hang is a slow program (kind "slow")."""
    kind = rng.choices(list(CODER_MIX), weights=list(CODER_MIX.values()))[0]
    if kind == "correct":
        program = problem["solution"]
    elif kind == "wrong":
        program = problem["prompt"] + "    return None\n"
    elif kind == "slow" or burn:
        seconds = rng.uniform(*SLOW_S)
        wait = BURN.format(seconds=seconds) if burn else f"import time\ntime.sleep({seconds:.2f})\n"
        kind, program = "slow", wait + problem["solution"]
    else:
        program = HANG + problem["solution"]
    return kind, f"```python\n{program}```"


def tester_answer(problem: dict[str, Any], rng: random.Random) -> str:
    """Some of the problem's own tests and one that no program passes, as one ```python block."""
    tests = [t["code"] for t in problem["tests"]]
    kept = sorted(rng.sample(range(len(tests)), rng.randint(1, len(tests))))
    lines = [tests[i] for i in kept] + [f"assert {problem['entry_point']} is None"]
    return "```python\n" + "\n".join(lines) + "\n```"


class ScriptedEngine(MockEngine):
    """MockEngine's time model with scripted code-env answers (see the module docstring).

    Completions have the script's own length in tokens; the modelled time is the mock's, for
    `max_tokens` decode steps, whatever the text: both sides pay the same for every batch.
    """

    def __init__(self, model_path: str | Path, *, seed: int = 0, **engine_args: Any) -> None:
        """Also a backend by path (`policies.<p>.backend: bench.lockstep:ScriptedEngine`): `engine_args`
        are the backend constructor's common arguments (dtype, max_batch_sequences)."""
        from mas_async.rollout.env_worker import load_tokenizer

        super().__init__(model_path, seed=seed, **engine_args)
        self.tokenizer = load_tokenizer(str(model_path))
        self.problems = {p["entry_point"]: p for p in load_own()}
        self.kinds: Counter[str] = Counter()
        """Answers written so far, by kind (coder kinds, and "tests"): the workload's fingerprint."""
        self.calls = 0
        """generate() calls (batches handed to the engine)."""

    burn = False
    """Slow programs spin on the CPU rather than sleep, and none hangs (`BurningScriptedEngine`)."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        self.calls += 1
        return super().generate(requests)

    def _completions(self, request: GenerationRequest) -> list[Completion]:
        prompt = self.tokenizer.decode(np.asarray(request.prompt_ids).tolist())
        task = TASK.search(prompt)
        if task is None or task.group(1) not in self.problems:
            raise ValueError("scripted engine: the prompt names none of the shipped code train problems")
        problem = self.problems[task.group(1)]
        completions = []
        for index in range(request.n):
            rng = random.Random(hashlib.sha256(f"{prompt}\0{index}".encode()).hexdigest())
            if CODER_SYSTEM.splitlines()[0] in prompt:
                kind, text = coder_answer(problem, rng, self.burn)
            elif TESTER_SYSTEM.splitlines()[0] in prompt:
                kind, text = "tests", tester_answer(problem, rng)
            else:
                raise ValueError("scripted engine: the prompt is neither the code coder's nor the tester's")
            self.kinds[kind] += 1
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if self.tokenizer.decode(ids) != text:
                raise ValueError(f"scripted engine: the tokenizer cannot spell the answer to {problem['id']}")
            completions.append(
                Completion(
                    token_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.zeros(len(ids), dtype=np.float32),
                    version=self.version,
                    finish_reason="stop",
                )
            )
        return completions


class BurningScriptedEngine(ScriptedEngine):
    """`ScriptedEngine` whose slow programs burn CPU (`policies.<p>.backend: bench.lockstep:BurningScriptedEngine`)."""

    burn = True


# -- the env ---------------------------------------------------------------------------------------


class TimedCodeEnv(CodeEnv):
    """The code env; every `astep` (the sandbox runs of one step) appends its seconds to
    `TimedCodeEnv.step_seconds` (one list per process). Episodes never end early: the workload is a
    fixed number of turns on both sides (a scripted coder that passes the hidden tests would end one)."""

    step_seconds: ClassVar[list[float]] = []

    async def astep(self, agent: str, action: Any) -> None:
        start = time.perf_counter()
        await super().astep(agent, action)
        self.terminations = dict.fromkeys(self.terminations, False)
        TimedCodeEnv.step_seconds.append(time.perf_counter() - start)


# -- the lockstep baseline -------------------------------------------------------------------------


class LockstepBatcher:
    """`generate` for lockstep episodes: every request waits until each of the `live` episodes has
    made `per_turn` requests (one per agent of a parallel workflow), then all go to the engine as
    one batch. An episode that ends calls `leave()`, so the others do not wait for it."""

    def __init__(
        self, backend: InferenceBackend, config: Config, stop_ids: list[int], per_turn: int, live: int
    ) -> None:
        self.backend = backend
        self.rollout = config.rollout
        self.stop_ids = stop_ids
        self.per_turn = per_turn
        self.live = live
        self.pending: list[tuple[GenerationRequest, asyncio.Future[list[Completion]]]] = []
        self.batches: list[int] = []  # sequences of each batch sent
        self._tasks: list[asyncio.Task] = []

    async def generate(self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool) -> list[Completion]:
        from mas_async.inference.request import GenerationRequest

        request = GenerationRequest(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32), n=n, max_tokens=self.rollout.max_tokens,
            temperature=self.rollout.temperature, top_p=self.rollout.top_p, greedy=greedy,
            stop_token_ids=self.stop_ids,
        )  # fmt: skip
        future: asyncio.Future[list[Completion]] = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        self._flush_if_ready()
        return await future

    def leave(self) -> None:
        self.live -= 1
        self._flush_if_ready()

    def _flush_if_ready(self) -> None:
        if self.pending and len(self.pending) >= self.per_turn * self.live:
            batch, self.pending = self.pending, []
            self.batches.append(sum(request.n for request, _ in batch))
            self._tasks.append(asyncio.get_running_loop().create_task(self._generate(batch)))

    async def _generate(self, batch: list[tuple[GenerationRequest, asyncio.Future[list[Completion]]]]) -> None:
        try:
            results = await self.backend.generate([request for request, _ in batch])
        except Exception as error:  # every waiting episode fails with the engine's error
            for _, future in batch:
                future.set_exception(error)
            return
        for (_, future), completions in zip(batch, results, strict=True):
            future.set_result(completions)


async def run_phase(
    config: Config, episodes: list[dict[str, Any]], backend: InferenceBackend, tokenizer: Any, stop_ids: list[int]
) -> dict[str, Any]:
    """Run one phase's episodes (dicts with episode_id, problem_id, problem, seed) in lockstep; the result's
    "samples" are every episode's recorded samples (what a lockstep trainer steps on)."""
    if len(config.policies) != 1:
        raise ValueError(f"the lockstep baseline serves one policy, the config has {sorted(config.policies)}")
    env_cls = resolve(config.env.name, ENVS, "env")
    nodes = {agent: resolve(spec.node, NODES, "node")(agent) for agent, spec in config.agents.items()}
    workflow = resolve(config.workflow.name, WORKFLOWS, "workflow")(nodes, **config.workflow.options)
    if not isinstance(workflow, ParallelWorkflow):
        raise ValueError(f"the lockstep baseline needs a parallel workflow, {config.workflow.name!r} is not one")
    batcher = LockstepBatcher(backend, config, stop_ids, per_turn=len(workflow.agents), live=len(episodes))
    policy = next(iter(config.policies))

    samples: list[Any] = []

    async def play(spec: dict[str, Any]) -> dict[str, Any]:
        try:
            env = env_cls()
            env.reset(seed=spec["seed"], options={"problem": spec["problem"]})
            episode = Episode(
                episode_id=spec["episode_id"],
                problem_id=spec["problem_id"],
                env=env,
                policy_of=config.policy_of(),
                tokenizers={policy: tokenizer},
                generate=batcher.generate,
                k=1 if config.algorithm.sampling == "parallel" else config.algorithm.k,
                alpha=config.algorithm.alpha,
                mode="train",
                seed=spec["seed"],
            )
            await workflow.run(episode)
            summary = episode.finish()
            samples.extend(episode.samples)
            return summary
        finally:
            batcher.leave()

    start = time.time()
    summaries = await asyncio.gather(*(play(spec) for spec in episodes))
    return {
        "start": start,
        "end": time.time(),
        "episodes": len(summaries),
        "turns": float(sum(s["turns"] for s in summaries)),
        "tokens": int(sum(s["tokens"] for s in summaries)),
        "batches": batcher.batches,
        "samples": samples,
    }
