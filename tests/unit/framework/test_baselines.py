"""Baselines beside the evaluation: a reference policy plays an episode through the run's workflow and
nodes (no generate, no sample), the router plans those episodes once per run on the held-out problems,
runs them beside a step without the step waiting for them, and reports them in the row."""

from __future__ import annotations

import asyncio
import random

import pytest

from envs.plan_path import PlanPathEnv
from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.metrics import EpisodeStats
from mas_async.rollout.baseline import BaselineEpisode, UnknownBaseline
from mas_async.rollout.episode import Episode
from mas_async.router.clock import VersionClock
from mas_async.router.episodes import EpisodeBook
from mas_async.router.hub import Router
from mas_async.router.report import iteration_row
from mas_async.wire.messages import PROTOCOL_VERSION, EpisodeDone, Groups, Hello, RunEpisode, TrainStep
from nodes.plan_path import HorizontalMover, PlanPathWorkflow, VerticalMover
from tests.support.paths import ROOT
from tests.unit.framework.test_episode import OPEN, FakeGenerate, FakeTokenizer, docstring_code
from tests.unit.framework.test_router_barrier import WORKERS, _done, _finish_step, _groups, _Sent

NAMES = list(PlanPathEnv.reference_policies())


def _baseline_episode(name: str, problem: dict, seed: int = 0) -> BaselineEpisode:
    env = PlanPathEnv()
    env.reset(options={"problem": problem})
    return BaselineEpisode(
        name=name,
        policies=PlanPathEnv.reference_policies(),
        rng=random.Random(seed),
        episode_id="b0",
        problem_id="test0",
        env=env,
        policy_of={"vertical": "v", "horizontal": "h"},
        alpha=1.0,
    )


def _play(episode, max_turns: int = 8) -> dict:
    workflow = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()}, max_turns=max_turns)
    asyncio.run(workflow.run(episode))
    return episode.finish()


def test_a_reference_policy_plays_through_the_workflow_and_is_scored_as_the_model_would_be() -> None:
    # OPEN: 3x3, start top-left, goal bottom-right; always D then R reaches it in two turns.
    baseline = _baseline_episode("always_D_R", OPEN)
    summary = _play(baseline)
    assert [c.action for c in baseline.committed] == ["D", "R", "D", "R"]
    assert summary["success"] and summary["turns"] == 2 and summary["tokens"] == 0
    assert summary["reward/vertical"] == 1.0 and summary["reward/horizontal"] == 1.5  # + alpha on the goal
    assert summary["progress_rate/vertical"] == summary["progress_rate/horizontal"] == 1.0
    assert baseline.samples == [] and baseline.mode == "baseline/always_D_R"
    # The same moves from a model's replies give the same rewards (the nodes score both alike).
    events: list[tuple] = []
    model = Episode(
        episode_id="e", problem_id="test0", env=_fresh(OPEN), policy_of={"vertical": "v", "horizontal": "h"},
        tokenizers={"v": FakeTokenizer(), "h": FakeTokenizer()}, generate=FakeGenerate([["D"], ["R"]] * 2, events),
        k=1, alpha=1.0, mode="eval",
    )  # fmt: skip
    played = _play(model)
    for key in ("success", "turns", "reward/vertical", "reward/horizontal", "progress_rate/vertical"):
        assert played[key] == summary[key], key
    assert played["tokens"] > 0 and "parse/invalid_rate/vertical" not in summary  # nothing was parsed


def test_a_wasted_move_lowers_the_progress_rate() -> None:
    baseline = _baseline_episode("always_U_L", OPEN)  # up and left off the top-left corner: both blocked
    summary = _play(baseline, max_turns=2)
    assert not summary["success"] and summary["progress_rate/vertical"] == 0.0
    assert summary["reward/vertical"] == -1.0  # each blocked move gets the node's penalty


def test_a_reply_that_did_not_parse_is_a_move_without_progress() -> None:
    events: list[tuple] = []
    episode = Episode(
        episode_id="e", problem_id="test0", env=_fresh(OPEN), policy_of={"vertical": "v", "horizontal": "h"},
        tokenizers={"v": FakeTokenizer(), "h": FakeTokenizer()}, generate=FakeGenerate([["D"], ["?"]], events),
        k=1, alpha=1.0, mode="eval",
    )  # fmt: skip
    summary = _play(episode, max_turns=1)
    assert summary["progress_rate/vertical"] == 1.0 and summary["progress_rate/horizontal"] == 0.0
    assert summary["parse/invalid_rate/horizontal"] == 1.0


def test_an_unknown_reference_policy_is_named() -> None:
    with pytest.raises(UnknownBaseline, match="PlanPathEnv has no reference policy 'nope': it has always_D_L"):
        _baseline_episode("nope", OPEN)


def test_the_docstring_toy_env_has_baselines() -> None:
    from mas_async.api import Env, Node, ParseError, Workflow, check_split

    scope = {"Env": Env, "check_split": check_split, "Node": Node, "ParseError": ParseError, "Workflow": Workflow}
    for cls in (Env, Node, Workflow):
        exec(docstring_code(cls), scope)
    echo = scope["Echo"]
    results = {}
    for name in echo.reference_policies():
        env = echo()
        env.reset(options={"problem": echo.problems("test", 1)[0]})
        episode = BaselineEpisode(
            name=name, policies=echo.reference_policies(), rng=random.Random(0), episode_id="b", problem_id="t",
            env=env, policy_of={"speaker": "pi"}, alpha=1.0,
        )  # fmt: skip
        asyncio.run(scope["workflow"].run(episode))
        results[name] = episode.finish()
    assert results["oracle"]["success"] and results["oracle"]["progress_rate/speaker"] == 1.0
    assert not results["silent"]["success"] and results["silent"]["reward/speaker"] == 0.0


def _fresh(problem: dict) -> PlanPathEnv:
    env = PlanPathEnv()
    env.reset(options={"problem": problem})
    return env


# -- the router ----------------------------------------------------------------------------------


def _router(tmp_path, *overrides: str, start_version: int = 0, training: bool = True) -> Router:
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=16", "env.test_size=4", "rollout.batch_size=2", "eval.size=2", "cluster.env_workers=2",
         "rollout.episodes_per_worker=1", "eval.baseline_draws=1", *overrides],
    )  # fmt: skip
    deployment = Deployment(
        "tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""},
        start_version=start_version, training=training,
    )  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()

    for ident in (*WORKERS, b"trainer/vertical", b"trainer/horizontal", b"inference/vertical/0",
                  b"inference/horizontal/0"):  # fmt: skip
        role = ident.decode().split("/")[0]
        policy = ident.decode().split("/")[1] if role != "env_worker" else ""
        router._on_hello(ident, Hello(role, ident.decode(), policy, 1, PROTOCOL_VERSION, 1))
    router.io.sent.clear()
    return router


def test_baselines_are_planned_once_per_run_on_the_evaluated_problems(tmp_path) -> None:
    router = _router(tmp_path / "a")
    first = list(router._episodes(0, 0, train=True, evaluate=True))
    evals = [t.msg for t in first if t.msg.mode == "eval"]
    for name in NAMES:
        runs = [t.msg for t in first if t.msg.mode == f"baseline/{name}"]
        assert [(r.problem_id, r.problem, r.seed) for r in runs] == [(e.problem_id, e.problem, e.seed) for e in evals]
    assert len(first) == 2 + 2 + 2 * len(NAMES)  # train, eval, then every baseline on the eval problems
    later = router._episodes(5, 5, train=True, evaluate=True)
    assert {t.msg.mode for t in later} == {"train", "eval"}  # measured once per run
    resumed = _router(tmp_path / "b", start_version=5)
    assert {t.msg.mode for t in resumed._episodes(5, 5, train=True, evaluate=True)} == {"train", "eval"}
    off = _router(tmp_path / "c", "eval.baselines=false")
    assert {t.msg.mode for t in off._episodes(0, 0, train=True, evaluate=True)} == {"train", "eval"}
    evaluation = _router(tmp_path / "d", start_version=5, training=False)  # `mas-async eval` of a checkpoint
    modes = {t.msg.mode for t in evaluation._episodes(5, 5, train=False, evaluate=True)}
    assert modes == {"eval", *(f"baseline/{n}" for n in NAMES)}


def test_the_clock_never_holds_a_baseline_back() -> None:
    clock = VersionClock(["p"], [("p", "inference/p/0")], start_version=0)
    clock.begin_step()  # a step is running: neither training nor evaluation episodes may start
    assert not clock.may_dispatch(0, "train") and not clock.may_dispatch(0, "eval")
    assert clock.may_dispatch(0, "baseline/random") and clock.may_dispatch(7, "baseline/random")
    with pytest.raises(ValueError, match="unknown episode mode 'bogus'"):
        clock.may_dispatch(0, "bogus")


def test_the_step_does_not_wait_for_baselines_and_the_row_does(tmp_path) -> None:
    async def scenario() -> dict:
        router = _router(tmp_path, "eval.size=1", "rollout.batch_size=1", "rollout.episodes_per_worker=1")
        iteration = asyncio.create_task(router._iteration(0, evaluate=True, train=True))
        await asyncio.sleep(0)
        runs = {m.mode: (w, m) for w, m in router.io.of(RunEpisode)}
        assert set(runs) == {"train", "eval"}  # two workers of capacity 1: the baselines wait for a slot
        _groups(router, runs["train"][1], "vertical", 4)
        _done(router, *runs["train"])
        _done(router, *runs["eval"], success=False)
        for _ in range(10):
            await asyncio.sleep(0)
        # The barrier's episodes are in: TrainStep goes out while the baselines still run.
        assert router.io.of(TrainStep)
        baseline = [(w, m) for w, m in router.io.of(RunEpisode) if m.mode.startswith("baseline/")]
        assert len(baseline) == 2 and router.clock.stepping  # dispatched beside the step
        worker, run = baseline[0]
        # A worker that sends groups for a baseline episode is refused: they never reach a trainer.
        refused = router.refused
        _groups(router, run, "vertical", 4)
        assert router.refused == refused + 1
        _finish_step(router, 1)
        await asyncio.sleep(0.05)
        assert not iteration.done()  # the row waits for the baselines
        for name in NAMES:
            for w, m in [(w, m) for w, m in router.io.of(RunEpisode) if m.mode == f"baseline/{name}"]:
                summary = {"success": name == "optimal", "reward/vertical": 0.5, "progress_rate/vertical": 1.0}
                router._handle(w, EpisodeDone(m.episode_id, 0, m.mode, m.attempt, "", summary | {"turns": 3}, {}))
            await asyncio.sleep(0)
        row = await asyncio.wait_for(iteration, 5)
        forwarded = [m for w, m in router.io.sent if w.startswith(b"trainer/") and isinstance(m, Groups)]
        assert [m.episode_id for m in forwarded] == [runs["train"][1].episode_id]
        return row

    row = asyncio.run(scenario())
    assert row["eval/baseline/optimal/team_success_rate"] == 1.0
    assert row["eval/baseline/random/team_success_rate"] == 0.0
    assert row["eval/baseline/random/reward/vertical"] == 0.5
    assert row["eval/baseline/random/progress_rate/vertical"] == 1.0
    assert row["eval/baseline/random/episodes"] == 1 and row["eval/baseline/random/dropped"] == 0
    assert row["eval/team_success_rate"] == 0.0 and row["eval/episodes"] == 1


def test_the_report_counts_a_dropped_baseline_episode_as_a_failure() -> None:
    run = RunEpisode("baseline-random-0-0", 0, "baseline/random", 0, "test0", {}, 0, 0)
    from mas_async.router.episodes import EpisodeTask

    book = EpisodeBook(0, 0, [EpisodeTask(run), EpisodeTask(RunEpisode("b1", 0, "baseline/random", 0, "t1", {}, 1, 0))])
    for task in iter(book.next_planned, None):
        book.in_flight[task.msg.episode_id] = task
    book.finish(EpisodeDone("baseline-random-0-0", 0, "eval", 0, "", {"success": True, "turns": 2}, {}))
    book.finish(EpisodeDone("b1", 0, "baseline/random", 0, "timed out", {}, {}))
    row = _row(book)
    assert row["eval/baseline/random/team_success_rate"] == 0.5 and row["eval/baseline/random/dropped"] == 1
    assert "eval/team_success_rate" not in row  # the worker's "eval" echo is not trusted: the book's mode is
    assert book.stats["baseline/random"].episodes == 1 and book.stats["eval"].episodes == 0


def test_a_row_leaves_out_what_nothing_measured() -> None:
    book = EpisodeBook(0, 0, [])
    book.dropped["train"] = 2  # every training episode failed: no turns were measured
    row = _row(book, train=True, trained={"p": {"samples": 0}})
    assert row["team/success_rate"] == 0.0 and row["rollout/dropped"] == 2
    for key in ("rollout/turns", "time/train_s", "time/weight_sync_s", "policy/p/entropy", "policy/p/kl"):
        assert key not in row, key
    assert not [k for k in row if k.startswith("eval/")]
    book.stats["train"].add({"success": True, "turns": 3, "tokens": 4})
    assert _row(book, train=True, trained={"p": {"time/train_s": 0.5}})["rollout/turns"] == 3
    stats = EpisodeStats()
    stats.add({"success": True})
    assert stats.means() == {"success": 1.0}


def _row(book: EpisodeBook, train: bool = False, trained: dict | None = None) -> dict:
    return iteration_row(
        book, eval_k=1, train=train, trained=trained or {}, version=0, rollout_s=1.0, step_s=0.0, malformed=0,
        refused_messages=0, refused_handshakes=0, elapsed_s=1.0,
    )  # fmt: skip


def test_baseline_draws_play_each_policy_several_times_per_problem_with_seeds_of_their_own(tmp_path) -> None:
    router = _router(tmp_path, "eval.baseline_draws=5")
    tasks = [t.msg for t in router._episodes(0, 0, train=True, evaluate=True)]
    evals = [t for t in tasks if t.mode == "eval"]
    assert len(evals) == 2  # the policy's own evaluation is not repeated
    for name in NAMES:
        runs = [t for t in tasks if t.mode == f"baseline/{name}"]
        assert len(runs) == 5 * len(evals)
        assert len({r.episode_id for r in runs}) == len(runs)
        for problem_id in {e.problem_id for e in evals}:
            assert len({r.seed for r in runs if r.problem_id == problem_id}) == 5
