"""The streamed strict step (`trainer.streaming`, training/streaming.py) makes the batch step's update.

A fixed set of samples (two agents of one policy, several turns, problems of one or several episodes) is
delivered episode by episode in several random orders, with compute passes cut at random points, and the
step is finished: the gradient equals the batch step's (`PolicyLearner.step` on the same samples) within
float rounding and the parameters after the step within 1e-6 relative (fp32), for grouping agent_turn
with std_scope group and agent, agent and trajectory, and with LoRA. Computing each delivery's
advantages on its own (the per-agent scale or a trajectory's mean taken per chunk) gives another update:
the deliveries do split what a problem's advantages need.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.training.streaming import StreamingStep, overlap_metrics
from mas_async.wire.messages import Groups, TrainStep, Withdrawn, sample_to_wire
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT
from tests.unit.framework.test_trainer_rule import _stepping_trainer

CONFIG = ROOT / "configs/plan_path_tiny_shared.yaml"
AGENTS = ("vertical", "horizontal")
TREE = ["algorithm.sampling=tree"]
PARALLEL = ["algorithm.sampling=parallel", "algorithm.k=3"]
CASES = {
    "agent_turn-group": [*TREE, "algorithm.grouping=agent_turn", "algorithm.std_scope=group"],
    "agent_turn-agent": [*TREE, "algorithm.grouping=agent_turn", "algorithm.std_scope=agent"],
    "agent": [*PARALLEL, "algorithm.grouping=agent"],
    "trajectory": [*PARALLEL, "algorithm.grouping=trajectory"],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def episodes(model_path: str, parallel: bool, seed: int = 0) -> list[tuple[str, int, list[Sample]]]:
    """(episode id, episodes of its problem, its samples) of one iteration of the policy `shared`.

    Tree sampling: 3 problems, the first drawn twice (2 episodes), each episode 2 turns of both agents
    with groups of 3 candidates from one prompt. Parallel sampling: 3 problems of 3 episodes, each 2 turns
    of both agents, one sample per call, one return per episode. Agent horizontal's rewards are 10x
    vertical's, so its own std differs from its groups' and from the other agent's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    rng = np.random.default_rng(seed)
    plan = [("p0", 3), ("p1", 3), ("p2", 3)] if parallel else [("p0", 2), ("p1", 1), ("p2", 1)]
    out = []
    for problem, count in plan:
        for copy in range(count):
            episode = f"{problem}-{copy}"
            samples: list[Sample] = []
            returns = float(rng.normal())
            for turn in range(2):
                for agent in AGENTS:
                    prompt = rng.integers(1, 30, size=int(rng.integers(3, 8))).astype(np.int32)
                    for _ in range(1 if parallel else 3):
                        completion = rng.integers(1, 30, size=int(rng.integers(1, 5))).astype(np.int32)
                        with torch.no_grad():
                            lp = completion_logprobs(model, [prompt], [completion])[0].numpy()
                        scale = 10.0 if agent == "horizontal" else 1.0
                        samples.append(
                            Sample(
                                f"{episode}/{agent}/{turn}", episode, problem, agent, "shared", turn, prompt,
                                completion, lp, 0, scale * float(rng.normal()), episode_return=returns,
                            )
                        )  # fmt: skip
            out.append((episode, count, samples))
    return out


def learner(model_path: str, *overrides: str, lr: float = 1e-4, dp=None) -> PolicyLearner:
    # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps, the float rounding of
    # a gradient summed in another order moves it by a visible share of lr; lr 1e-4 keeps the parameters
    # well within 1e-6 relative (~4e-8), and the gradients themselves are compared too.
    config = load_config(CONFIG, [f"policies.shared.lr={lr}", *overrides])
    torch.manual_seed(0)
    return PolicyLearner(config, "shared", model_path, dp=dp)


def streamed(learner: PolicyLearner, delivered, cuts: set[int], each_alone: bool = False) -> dict:
    """Finish a streamed step fed `delivered` episodes in that order, with a compute pass run (drained) after
    each delivery whose position is in `cuts`. `each_alone`: every delivery is taken as a whole problem."""

    async def run() -> dict:
        step = StreamingStep(learner, 0)
        for n, (episode, count, samples) in enumerate(delivered):
            step.add(samples, episode, 1 if each_alone else count)
            if n in cuts:
                await step.drain()
        metrics = await step.finish()
        metrics["passes"] = len(step.busy)
        return metrics

    return asyncio.run(run())


def grads(learner: PolicyLearner) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in learner.model.parameters() if p.grad is not None]


def params(learner: PolicyLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in learner.trained]


def assert_same_update(a: PolicyLearner, b: PolicyLearner, start: list[torch.Tensor]) -> None:
    """The same gradient (each tensor within 1e-5 of its largest entry: float rounding, summed in another
    order) and the same parameters after the step (within 1e-6 relative: of the norm of all of them)."""
    ga, gb = grads(a), grads(b)
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb, strict=True):
        assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max()), float((x - y).abs().max())
    pa, pb, p0 = (torch.cat([p.flatten() for p in ps]) for ps in (params(a), params(b), start))
    assert float((pb - p0).abs().max()) > 5e-5  # the step changed the weights
    assert float((pa - pb).norm()) <= 1e-6 * float(pb.norm()), float((pa - pb).norm() / pb.norm())


def orders(delivered: list, seed: int) -> tuple[list, set[int]]:
    """A random order of the episodes and random points after which a compute pass runs."""
    rng = np.random.default_rng(seed)
    order = [delivered[i] for i in rng.permutation(len(delivered))]
    size = int(rng.integers(1, len(order))) if len(order) > 1 else 0
    return order, {int(i) for i in rng.choice(len(order), size=size, replace=False)}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_step_equals_the_batch_step(model_path, case):
    overrides = CASES[case]
    delivered = episodes(model_path, parallel="algorithm.sampling=parallel" in overrides)
    batch = learner(model_path, *overrides)
    start = params(batch)
    expected = batch.step([s for _, _, samples in delivered for s in samples], 0)
    for seed in range(3):
        order, cuts = orders(delivered, seed)
        stream = learner(model_path, *overrides)
        metrics = streamed(stream, order, cuts)
        assert metrics["passes"] >= 2  # (cuts in several places: the compute came in pieces)
        assert_same_update(stream, batch, start)
        for key in ("samples", "tokens", "active_samples", "optimizer_steps"):
            assert metrics[key] == expected[key], key
        for key in ("loss", "grad_norm", "advantage_abs_mean", "reward_mean", "logprob_abs_diff", "clip_fraction"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        assert metrics["logprob_abs_diff"] < 1e-5


@pytest.mark.parametrize("case", ["agent_turn-agent", "trajectory"])
def test_advantages_taken_per_delivery_give_another_update(model_path, case):
    """The negative control: the deliveries split problems (a problem drawn twice under tree sampling, a
    problem's K episodes under parallel sampling), so a step that normalised each compute pass's samples on
    their own (the per-agent scale, or a trajectory's mean and std, per chunk) would not make the batch
    update: here every delivery counts as a whole problem, and a pass runs after each one (tree sampling)
    or after every second one (parallel sampling: a problem's 3 episodes are never in one pass)."""
    overrides = CASES[case]
    delivered = episodes(model_path, parallel=case == "trajectory")
    batch = learner(model_path, *overrides)
    batch.step([s for _, _, samples in delivered for s in samples], 0)
    stream = learner(model_path, *overrides)
    every = 2 if case == "trajectory" else 1
    streamed(stream, delivered, {n for n in range(len(delivered)) if n % every == every - 1}, each_alone=True)
    ga, gb = grads(stream), grads(batch)
    assert len(ga) == len(gb) > 0
    assert max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(ga, gb, strict=True)) > 1e-2


def test_streamed_step_with_lora(model_path):
    overrides = [*CASES["agent_turn-agent"], "policies.shared.lora={r: 4}"]
    delivered = episodes(model_path, parallel=False, seed=1)
    batch = learner(model_path, *overrides, lr=1e-3)
    start = params(batch)
    batch.step([s for _, _, samples in delivered for s in samples], 0)
    order, cuts = orders(delivered, 5)
    stream = learner(model_path, *overrides, lr=1e-3)
    streamed(stream, order, cuts)
    assert len(start) and all("lora" in name for name, _ in stream.trained)
    assert_same_update(stream, batch, start)


def test_samples_wait_for_their_problem_and_a_dropped_episode_is_computed_at_the_end(model_path):
    """A problem of 3 episodes is computed once its third is in; one that lost an episode at the finish."""
    delivered = episodes(model_path, parallel=True)
    stream_learner = learner(model_path, *CASES["trajectory"])

    async def run() -> tuple[list[int], dict]:
        step = StreamingStep(stream_learner, 0)
        computed = []
        for episode, count, samples in delivered[:5]:  # p0's 3 episodes, 2 of p1's 3
            step.add(samples, episode, count)
            await step.drain()
            computed.append(len(step.samples))
        metrics = await step.finish()
        return computed, metrics

    computed, metrics = asyncio.run(run())
    per_episode = len(delivered[0][2])
    assert computed == [0, 0, 3 * per_episode, 3 * per_episode, 3 * per_episode]
    assert metrics["samples"] == 5 * per_episode
    # What bounded the overlap: p0 (3 of the 5 episodes' samples) was complete before the last samples came.
    assert metrics["time/given_samples"] == 5 * per_episode and metrics["time/ready_early_samples"] == 3 * per_episode
    assert metrics["time/ready_lead_s"] > 0
    ready = overlap_metrics([metrics], 0.0)
    assert ready["trainer/ready_early"] == 0.6 and ready["trainer/ready_lead_s"] == metrics["time/ready_lead_s"]
    batch = learner(model_path, *CASES["trajectory"])
    start = params(batch)
    batch.step([s for _, _, samples in delivered[:5] for s in samples], 0)
    assert_same_update(stream_learner, batch, start)


def test_overlap_and_tail_come_from_every_rank_and_are_left_out_when_unmeasured():
    ranks = [
        {"time/compute_s": 4.0, "time/early_compute_s": 3.0, "last_group_at": 100.0},
        {"time/compute_s": 2.0, "time/early_compute_s": 0.0, "last_group_at": 101.5},
    ]
    assert overlap_metrics(ranks, 103.0) == {"trainer/compute_s": 6.0, "trainer/overlap": 0.5, "trainer/tail_s": 1.5}
    streamed = [
        {**ranks[0], "time/given_samples": 6, "time/ready_early_samples": 4, "time/ready_lead_s": 2.0},
        {**ranks[1], "time/given_samples": 2, "time/ready_early_samples": 0, "time/ready_lead_s": 0.0},
    ]
    ready = overlap_metrics(streamed, 103.0)
    assert ready["trainer/ready_early"] == 0.5 and ready["trainer/ready_lead_s"] == 2.0
    assert overlap_metrics([{"samples": 0}], 103.0) == {}


def test_streaming_is_on_where_the_step_is_one_optimiser_step_and_refused_with_a_sentence_elsewhere():
    assert load_config(CONFIG).streams()
    assert not load_config(CONFIG, ["trainer.streaming=false"]).streams()
    for overrides in (["algorithm.ppo_epochs=2"], ["algorithm.mini_batches=2"], ["rollout.max_staleness=1"]):
        assert not load_config(CONFIG, overrides).streams()  # the default falls back to the batch step
    with pytest.raises(ConfigError, match=r"trainer.streaming=true .* algorithm.ppo_epochs=2 .* set both to 1"):
        load_config(CONFIG, ["trainer.streaming=true", "algorithm.ppo_epochs=2"])
    with pytest.raises(ConfigError, match=r"trainer.streaming=true .* rollout.max_staleness=1"):
        load_config(CONFIG, ["trainer.streaming=true", "rollout.max_staleness=1"])


def vertical_groups(episode: int) -> Groups:
    """Episode `episode`'s one group of iteration 0 for policy vertical: 4 samples of problem p<episode>."""
    samples = [
        Sample(f"train0-{episode}/vertical/0", f"train0-{episode}", f"p{episode}", "vertical", "vertical", 0,
               np.array([1, 5, 6, 7], dtype=np.int32), np.array([20 + i], dtype=np.int32),
               np.array([-3.4], dtype=np.float32), 0, float(i))
        for i in range(4)
    ]  # fmt: skip
    return Groups("vertical", 0, f"train0-{episode}", 0, 4, 20, [sample_to_wire(s) for s in samples], 1)


def test_the_trainer_computes_each_episode_when_it_arrives_and_steps_at_trainstep(model_path):
    """Through the Trainer's messages: the first episode's samples are computed before the second arrives
    and before TrainStep (the stubbed batch step is never called); the step's row has the overlap."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, dict.fromkeys(AGENTS, model_path))
    trainer, sent = _stepping_trainer((config, deployment), lambda: None)
    assert trainer.streams

    async def run() -> list[int]:
        computed = []
        for episode in range(2):
            await trainer.on_message(vertical_groups(episode))
            assert trainer.stream is not None
            await trainer.stream.drain()
            computed.append(len(trainer.stream.samples))
        await trainer._step(TrainStep("vertical", 0, 0, 8))
        return computed

    assert asyncio.run(run()) == [4, 8]
    metrics = sent[-1].metrics
    assert sent[-1].version == 1 and metrics["samples"] == 8 and metrics["optimizer_steps"] == 1
    assert metrics["active_samples"] == 8 and metrics["version_mismatch"] == 0
    assert 0.0 < metrics["trainer/overlap"] < 1.0  # the first episode's pass came before the last group
    assert metrics["trainer/tail_s"] >= 0.0


def by_group(delivered: list) -> list[tuple[str, int, list[Sample]]]:
    """Each episode's groups as deliveries of their own (groups streamed by turn), in the episodes' order."""
    out = []
    for episode, count, samples in delivered:
        for group in dict.fromkeys(s.group for s in samples):
            out.append((episode, count, [s for s in samples if s.group == group]))
    return out


@pytest.mark.parametrize("computed_first", [True, False])
def test_groups_streamed_by_turn_and_a_withdrawn_attempt_give_the_batch_step_of_the_others(model_path, computed_first):
    """Tree sampling, agent_turn, std_scope group (`Config.streams_turns`): every group delivered alone, in a
    random order with random passes, and one episode's attempt withdrawn after its groups came: the update is
    the batch step's on the other episodes' samples, whether a pass had computed the withdrawn groups (the
    step is computed again at the end) or not (they came first and waited for their problem's other
    episode: they are dropped before any pass)."""
    overrides = CASES["agent_turn-group"]
    assert load_config(CONFIG, overrides).streams_turns()
    delivered = episodes(model_path, parallel=False)
    lost = delivered[1][0]  # p0's second episode: its problem keeps the first
    groups = by_group(delivered)
    order, cuts = orders(groups, seed=3)
    stream_learner = learner(model_path, *overrides)

    mine = [g for g in groups if g[0] == lost]
    if not computed_first:  # its groups first: they wait for p0's first episode
        order = mine + [g for g in order if g[0] != lost]

    async def run() -> StreamingStep:
        step = StreamingStep(stream_learner, 0)
        for n, (episode, count, samples) in enumerate(order):
            step.add(samples, episode, count)
            if n in cuts or computed_first:
                await step.drain()
            if n == len(mine) - 1 and not computed_first:
                assert step.withdraw(lost, 0) == sum(len(samples) for _, _, samples in mine)
        await step.drain()
        if computed_first:
            assert step.withdraw(lost, 0) == sum(len(samples) for _, _, samples in mine)
        assert step.withdraw(lost, 0) == 0  # (again: nothing left to take back)
        await step.finish()
        return step

    step = asyncio.run(run())
    assert step.redo is computed_first
    kept = [s for episode, _, samples in delivered if episode != lost for s in samples]
    assert step.given == len(step.samples) == len(kept)
    # The overlap figures count what the step kept: no withdrawn sample is ready early, no thrown-away pass early.
    timing = step.timing()
    withdrawn_keys = {key for _, keys in step.completed for key in keys if key.episode_id == lost}
    assert withdrawn_keys <= step.withdrawn
    ready = sum(key not in step.withdrawn for when, keys in step.completed if when < step.last_arrival for key in keys)
    assert timing["time/ready_early_samples"] == ready <= timing["time/given_samples"] == len(kept)
    if computed_first:  # every pass before the redo was thrown away; the redo came after the last arrival
        assert timing["time/early_compute_s"] == 0.0 < timing["time/compute_s"]
    batch = learner(model_path, *overrides)
    start = params(batch)
    batch.step(kept, 0)
    assert_same_update(stream_learner, batch, start)


def test_groups_stream_by_turn_only_where_a_group_s_advantages_need_no_other_sample():
    assert load_config(CONFIG, TREE).streams_turns()
    for overrides in (
        [*TREE, "algorithm.std_scope=agent"],
        [*PARALLEL, "algorithm.grouping=agent"],
        [*TREE, "trainer.streaming=false"],
        [*TREE, "cluster.leases=true"],
    ):
        assert not load_config(CONFIG, overrides).streams_turns(), overrides


def test_the_trainer_takes_groups_one_at_a_time_and_drops_a_withdrawn_attempt_s(model_path):
    """Through the Trainer's messages, groups streamed by turn: two episodes' groups come one message each,
    the router withdraws the second episode's attempt 0 (its groups were computed) and its attempt 1 comes
    again; the step trains the first episode's and attempt 1's, each episode counted once."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    assert config.streams_turns()
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, dict.fromkeys(AGENTS, model_path))
    trainer, sent = _stepping_trainer((config, deployment), lambda: None)

    def group(episode: int, turn: int, attempt: int = 0) -> Groups:
        samples = [
            Sample(f"train0-{episode}/vertical/{turn}", f"train0-{episode}", f"p{episode}", "vertical", "vertical",
                   turn, np.array([1, 5, 6, 7 + turn], dtype=np.int32), np.array([20 + i], dtype=np.int32),
                   np.array([-3.4], dtype=np.float32), 0, float(i))
            for i in range(4)
        ]  # fmt: skip
        wire = [sample_to_wire(s) for s in samples]
        return Groups("vertical", 0, f"train0-{episode}", attempt, 4, 20, wire, 1)

    async def run() -> None:
        for message in (group(0, 0), group(1, 0), group(0, 1), group(1, 1)):
            await trainer.on_message(message)
        assert trainer.stream is not None
        await trainer.stream.drain()
        await trainer.on_message(Withdrawn("vertical", 0, "train0-1", 0))
        await trainer.on_message(Withdrawn("vertical", 0, "train0-1", 0))  # (again: nothing left to drop)
        for message in (group(1, 0, attempt=1), group(1, 1, attempt=1)):
            await trainer.on_message(message)
        assert trainer.stream.redo and trainer.stream.given == 16
        await trainer._step(TrainStep("vertical", 0, 0, 16))

    asyncio.run(run())
    metrics = sent[-1].metrics
    assert not sent[-1].error and metrics["samples"] == 16 and metrics["version_mismatch"] == 0
    assert metrics["episodes"] == 2 and metrics["repeated_episodes"] == 0


def _threads_of_a_new_thread() -> int:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()


def _record_threads(learner: PolicyLearner) -> list[tuple[str, int]]:
    """(what ran, its thread's torch threads) of each compute and of the optimiser step of `learner`."""
    seen: list[tuple[str, int]] = []
    accumulate, optimizer_step = learner._accumulate, learner.optimizer_step

    def recording_accumulate(*args, **kwargs):
        seen.append(("pass", torch.get_num_threads()))
        return accumulate(*args, **kwargs)

    def recording_optimizer_step(*args, **kwargs):
        seen.append(("optimizer", torch.get_num_threads()))
        return optimizer_step(*args, **kwargs)

    learner._accumulate, learner.optimizer_step = recording_accumulate, recording_optimizer_step
    return seen


def test_the_tail_of_a_streamed_step_runs_on_tail_threads_and_gives_the_same_update(model_path):
    """`trainer.tail_threads`: the passes begun before the tail keep the thread's own torch threads; the pass
    begun after `begin_tail` and the finish take `tail_threads`; afterwards every thread is as before; the
    update is the batch step's."""
    base = _threads_of_a_new_thread()
    main_before = torch.get_num_threads()
    tail = base + 1
    overrides = CASES["agent_turn-group"]
    delivered = episodes(model_path, parallel=False)
    stream = learner(model_path, *overrides)
    seen = _record_threads(stream)

    async def run() -> None:
        step = StreamingStep(stream, 0, tail_threads=tail)
        for episode, count, samples in delivered[:2]:  # p0's two episodes: a complete problem, one pass
            step.add(samples, episode, count)
        await step.drain()
        step.begin_tail()
        for episode, count, samples in delivered[2:]:
            step.add(samples, episode, count)
        await step.drain()
        await step.finish()

    asyncio.run(run())
    assert seen == [("pass", base), ("pass", tail), ("optimizer", tail)], seen
    assert _threads_of_a_new_thread() == base and torch.get_num_threads() == main_before
    batch = learner(model_path, *overrides)
    start = params(batch)
    batch.step([s for _, _, samples in delivered for s in samples], 0)
    assert_same_update(stream, batch, start)


def test_a_pass_under_way_when_the_tail_begins_takes_tail_threads_from_its_next_problems(model_path):
    """One pass over every problem (`trainer.micro_batch_sequences` 1: a problem a run); the tail begins while
    it computes the first problem: the next two take `tail_threads`. The update is the batch step's."""
    base = _threads_of_a_new_thread()
    overrides = [*CASES["agent_turn-group"], "trainer.micro_batch_sequences=1"]
    delivered = episodes(model_path, parallel=False)
    every = [s for _, _, samples in delivered for s in samples]
    stream = learner(model_path, *overrides)
    seen = _record_threads(stream)
    first_began, gate = threading.Event(), threading.Event()
    accumulate = stream._accumulate

    def first_waits(*args, **kwargs):
        if not first_began.is_set():
            first_began.set()
            gate.wait(10)
        return accumulate(*args, **kwargs)

    stream._accumulate = first_waits

    async def run() -> None:
        step = StreamingStep(stream, 0, tail_threads=base + 1)
        step.add(every, "every", 1)  # (one delivery, every problem complete: one pass)
        assert await asyncio.to_thread(first_began.wait, 10)
        step.begin_tail()
        gate.set()
        await step.finish()
        assert len(step.busy) == 2  # the pass and the finish

    asyncio.run(run())
    assert seen == [("pass", base), ("pass", base + 1), ("pass", base + 1), ("optimizer", base + 1)], seen
    batch = learner(model_path, *overrides)
    start = params(batch)
    batch.step(every, 0)
    assert_same_update(stream, batch, start)


def test_without_tail_threads_the_whole_streamed_step_keeps_the_thread_s_own(model_path):
    base = _threads_of_a_new_thread()
    delivered = episodes(model_path, parallel=False)
    stream = learner(model_path, *CASES["agent_turn-group"])
    seen = _record_threads(stream)

    async def run() -> None:
        step = StreamingStep(stream, 0)
        step.begin_tail()
        for episode, count, samples in delivered:
            step.add(samples, episode, count)
        await step.finish()

    asyncio.run(run())
    assert seen and {threads for _, threads in seen} == {base}


def test_finish_begins_the_tail_if_nothing_began_it(model_path):
    base = _threads_of_a_new_thread()
    delivered = episodes(model_path, parallel=False)
    stream = learner(model_path, *CASES["agent_turn-group"])
    seen = _record_threads(stream)

    async def run() -> None:
        step = StreamingStep(stream, 0, tail_threads=base + 1)
        for episode, count, samples in delivered:
            step.add(samples, episode, count)
        await step.drain()
        await step.finish()

    asyncio.run(run())
    assert seen[-1] == ("optimizer", base + 1) and {threads for _, threads in seen[:-1]} == {base}, seen


def test_the_trainer_begins_the_tail_at_trainstep_on_trainer_tail_threads(model_path):
    """Through the Trainer's messages, `trainer.tail_threads: 3`: of two groups that came before TrainStep, the
    first one's pass (begun before it) keeps the thread's own torch threads; the second one's, held back until
    TrainStep came, and the finish's optimiser step take 3."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["trainer.tail_threads=3"])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, dict.fromkeys(AGENTS, model_path))
    trainer, sent = _stepping_trainer((config, deployment), lambda: None)
    seen = _record_threads(trainer.learner)
    base = _threads_of_a_new_thread()
    assert base != 3
    first_began, gate = threading.Event(), threading.Event()
    """The first pass waits for the gate (at most 10 s), so the second one begins after TrainStep."""
    accumulate = trainer.learner._accumulate

    def first_waits(*args, **kwargs):
        if not first_began.is_set():
            first_began.set()
            gate.wait(10)
        return accumulate(*args, **kwargs)

    trainer.learner._accumulate = first_waits

    async def open_the_gate_in_the_tail() -> None:
        while not trainer.stream.tail:
            await asyncio.sleep(0.001)
        gate.set()

    async def run() -> None:
        await trainer.on_message(vertical_groups(0))
        assert await asyncio.to_thread(first_began.wait, 10)  # (the first pass took group 0 alone)
        await trainer.on_message(vertical_groups(1))
        opener = asyncio.create_task(open_the_gate_in_the_tail())
        await trainer._step(TrainStep("vertical", 0, 0, 8))
        await opener

    asyncio.run(run())
    assert sent[-1].version == 1 and sent[-1].metrics["optimizer_steps"] == 1
    assert seen == [("pass", base), ("pass", 3), ("optimizer", 3)], seen
