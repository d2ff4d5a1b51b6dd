"""The router's book of one iteration's episodes: what is queued, what runs where, what came back.

Each dispatch of an episode is an attempt (`RunEpisode.attempt`, 0, 1, ...). An episode's Groups are
held until its EpisodeDone of the same attempt arrives and only then forwarded to the trainers, so a
failed episode, a timed-out one or an abandoned attempt (its worker was declared dead and the episode
runs again elsewhere) never contributes a sample, and no episode is counted twice. When groups stream by
turn (`Config.streams_turns`) they are forwarded as they come instead, and the trainers are told to drop
those of an attempt that fails or is abandoned (`Withdrawn`); they count into the step only once the
attempt is done. Whatever arrives for an attempt that is not the current one is dropped and counted
(`late`).

Baseline episodes ("baseline/<name>": a reference policy of the env plays, `rollout/baseline.py`) are
in the book of the run's first evaluation, but outside its barrier: `done` (what the step waits for)
is set when the training and evaluation episodes are in, `all_done` when the baseline ones are too
(the row waits for those, the weight update never does). They generate nothing and send no groups.

Attempts are capped (`rollout.max_attempts`): an episode that was running on that many lost workers is
poisoned (it kills whatever runs it) and is dropped, counted in `poisoned` by its problem id, instead of
being dispatched again. Its last attempt is `alone`: the router runs it on a worker that runs nothing else,
so an episode that merely shared a worker with a poisoned one is not taken for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mas_async.metrics import EpisodeStats
from mas_async.wire.messages import EpisodeDone, RunEpisode

log = logging.getLogger(__name__)

MODES = ("train", "eval")
"""Modes whose episodes the iteration's barrier waits for; any other is a baseline/<name> episode."""


@dataclass
class EpisodeTask:
    msg: RunEpisode
    worker: bytes | None = None
    deadline: float = 0.0
    groups: list[tuple[str, int, int, list]] = field(default_factory=list)
    """(policy, samples, tokens, frames) of each Groups message of the current attempt, held until it is done."""
    streamed: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    """(policy, trainer rank) -> [samples, tokens] of the current attempt's Groups forwarded before it was
    done (groups streamed by turn): counted into the step when it is done; its ranks are told to drop them
    when it fails or is abandoned (`Withdrawn`)."""
    alone: bool = False
    """The episode's last attempt: it runs on a worker that runs no other episode meanwhile."""


class EpisodeBook:
    """Queued and in-flight episodes of one iteration and what their results added up to."""

    def __init__(self, iteration: int, version: int, tasks: Iterable[EpisodeTask]) -> None:
        self.iteration = iteration
        self.version = version
        """The version whose step trains this iteration's samples (strict mode: the version every
        episode runs at; bounded staleness: episodes run at version - k or later)."""
        self.opened_at = time.monotonic()
        self.done_at = 0.0
        """When the last episode came in (or was dropped)."""
        self._plan = iter(tasks)
        """The episodes not taken yet: the router takes them as it dispatches them, a slice at a time, never
        thousands in one turn of its loop. The plan lists the barrier's episodes (train, eval) before any
        baseline's."""
        self._next: EpisodeTask | None = next(self._plan, None)
        """The plan's next episode (None once every one was taken)."""
        self.queued: list[EpisodeTask] = []
        """Episodes taken from the plan, or put back as a new attempt, that wait to be dispatched, in order."""
        self.in_flight: dict[str, EpisodeTask] = {}
        self.stats = {mode: EpisodeStats() for mode in MODES}
        """mode -> what its finished episodes added up to ("train", "eval", then "baseline/<name>"... in the
        plan's order, each added when its first episode is taken from the plan)."""
        self.dropped = dict.fromkeys(self.stats, 0)
        self.eval_solved: dict[str, list[bool]] = {}
        """test problem -> success of each of its eval.k episodes (for pass@k)."""
        self.first_error = ""
        self.late = 0
        """Groups or EpisodeDone messages of an attempt that is not current (dropped)."""
        self.poisoned: list[str] = []
        """Problem ids of the episodes dropped as poisoned (also counted in `dropped`)."""
        self.done = asyncio.Event()
        """Every training and evaluation episode is in (or dropped): the step may begin."""
        self.all_done = asyncio.Event()
        """Every episode is in, the baseline ones too: the iteration's row may be written."""
        self._trainer_ranks: dict[tuple[str, str], int] = {}
        """(policy, problem id) -> the trainer rank that gets the groups of every episode of that problem."""
        self._problems_of_rank: Counter[tuple[str, int]] = Counter()
        """(policy, trainer rank) -> problems whose groups go to that rank."""

    @property
    def planned(self) -> bool:
        """Whether every episode of the plan was taken (queued, dispatched or dropped)."""
        return self._next is None

    def next_planned(self, poisoned: Container[str] = ()) -> EpisodeTask | None:
        """The plan's next episode (None when every one was taken); one of a problem in `poisoned` is dropped
        as poisoned instead (it killed its workers in an earlier iteration: counted again, never run again)."""
        while self._next is not None:
            task, self._next = self._next, next(self._plan, None)
            mode = task.msg.mode
            if mode not in self.stats:  # a baseline's first episode
                self.stats[mode], self.dropped[mode] = EpisodeStats(), 0
            if task.msg.problem_id not in poisoned:
                return task
            self.poison(task)
            log.warning("episode %s (problem %s) is not run: the problem was poisoned", task.msg.episode_id,
                        task.msg.problem_id)  # fmt: skip
        self.check_done()
        return None

    def trainer_rank(self, policy: str, problem_id: str, least_loaded: Callable[[], int]) -> int:
        """The trainer rank of `policy` that gets this problem's groups: the least-loaded one when its first
        episode is done, the same one for the others. A problem's groups stay on one rank because its
        advantages are relative to them all: under parallel sampling its K episodes form the `trajectory`
        group, and the `agent` grouping pools each agent's samples over them; a rank holding part of them
        would normalise over that part (returns [1, 0, 1, 1] give advantages [.58, -1.73, .58, .58]; split
        as [1, 0] and [1, 1] over two ranks they give [1, -1] and [0, 0])."""
        key = (policy, problem_id)
        if key not in self._trainer_ranks:
            self._trainer_ranks[key] = rank = least_loaded()
            self._problems_of_rank[(policy, rank)] += 1
        return self._trainer_ranks[key]

    def fewest_problems(self, policy: str, ranks: int) -> int:
        """The trainer rank of `policy` (of `ranks`) with the fewest problems so far (the lowest such rank)."""
        return min(range(ranks), key=lambda rank: (self._problems_of_rank[(policy, rank)], rank))

    def success_rate(self, mode: str) -> float:
        """Successes over every episode of `mode` that was dispatched: a failed or timed-out one counts
        as a failure, never left out of the denominator."""
        ran = self.stats[mode].episodes + self.dropped[mode]
        return self.stats[mode].sums.get("success", 0.0) / max(1, ran)

    def current(self, episode_id: str, iteration: int, attempt: int) -> EpisodeTask | None:
        task = self.in_flight.get(episode_id)
        if iteration != self.iteration or task is None or task.msg.attempt != attempt:
            return None
        return task

    def hold_groups(self, header: Any, frames: list) -> bool:
        """Keep a Groups message until its episode is done; False (and counted) if it is late."""
        task = self.current(header.episode_id, header.iteration, header.attempt)
        if task is None:
            self.late += 1
            return False
        task.groups.append((header.policy, header.n_samples, header.n_tokens, frames))
        return True

    def finish(self, msg: EpisodeDone) -> EpisodeTask | None:
        """Record an EpisodeDone; returns the finished task (its held groups are to be forwarded when
        it succeeded), or None when the message is late."""
        task = self.current(msg.episode_id, msg.iteration, msg.attempt)
        if task is None:
            self.late += 1
            return None
        del self.in_flight[msg.episode_id]
        mode = task.msg.mode  # the dispatched one (the worker's echo of it is not trusted)
        if msg.error:
            self.dropped[mode] += 1
            self.first_error = self.first_error or msg.error
            task.groups.clear()
        else:
            self.stats[mode].add(msg.summary)
            if mode == "eval":
                self.eval_solved.setdefault(task.msg.problem_id, []).append(bool(msg.summary.get("success")))
        return task

    def requeue(self, worker: bytes, max_attempts: int) -> tuple[int, list[EpisodeTask]]:
        """Put every episode that `worker` was running back in the queue as a new attempt, unless it has had
        `max_attempts` (then it is dropped as poisoned). Returns (episodes queued again, episodes poisoned)."""
        lost = [task for task in self.in_flight.values() if task.worker == worker]
        poisoned = []
        for task in lost:
            del self.in_flight[task.msg.episode_id]
            old = task.msg
            if old.attempt + 1 >= max_attempts:
                self.poison(task)
                poisoned.append(task)
                continue
            msg = RunEpisode(
                old.episode_id, old.iteration, old.mode, old.attempt + 1, old.problem_id, old.problem, old.seed,
                old.version, old.problem_episodes,
            )  # fmt: skip
            self.queued.append(EpisodeTask(msg, alone=old.attempt + 2 == max_attempts))
        self.check_done()
        return len(lost) - len(poisoned), poisoned

    def poison(self, task: EpisodeTask) -> None:
        """Drop `task` (no longer queued or in flight) as poisoned: counted as dropped and by its problem id."""
        self.dropped[task.msg.mode] += 1
        self.poisoned.append(task.msg.problem_id)
        self.first_error = self.first_error or f"episode {task.msg.episode_id} poisoned"

    def overdue(self, now: float) -> list[EpisodeTask]:
        return [task for task in self.in_flight.values() if now > task.deadline]

    def generating(self) -> bool:
        """Whether an episode that sends generate requests is in flight (a baseline one sends none)."""
        return any(task.msg.mode in MODES for task in self.in_flight.values())

    def check_done(self) -> None:
        if not self.done.is_set():
            planned = self._next is None or self._next.msg.mode not in MODES  # (the barrier's come first)
            if planned and not any(t.msg.mode in MODES for t in itertools.chain(self.queued, self.in_flight.values())):
                self.done_at = time.monotonic()
                self.done.set()
        if self._next is None and not self.queued and not self.in_flight:
            self.all_done.set()


def plan_episodes(
    config: Any,
    train_problems: list[dict],
    test_problems: list[dict],
    order: list[int],
    iteration: int,
    version: int,
    *,
    train: bool,
    evaluate: bool,
    baselines: list[str] = (),
) -> Iterator[EpisodeTask]:
    """The iteration's episodes, made as they are taken: `rollout.batch_size` training problems (each run by
    `episodes_per_problem` episodes: one under tree sampling, K under parallel sampling) and, when
    evaluating, `eval.size` test problems with eval.k episodes each; then, for each reference policy in
    `baselines`, the same test problems with the same episode seeds, played by that policy (times
    `eval.baseline_draws`, each draw with a seed of its own)."""
    from mas_async.rollout.episode import episodes_per_problem

    if train:
        size, copies = config.rollout.batch_size, episodes_per_problem(config, "train")
        positions = [order[(iteration * size + index) % len(order)] for index in range(size)]
        # A problem drawn twice in one iteration (more problems per batch than the dataset holds) shares its
        # advantages' statistics over both draws' episodes: the trainers learn how many episodes to wait for.
        drawn = Counter(positions)
        for index, position in enumerate(positions):
            for copy in range(copies):
                seed = hash((config.run.seed, iteration, index, copy)) & 0x7FFFFFFF  # ints: not salted
                suffix = f"-{copy}" if copies > 1 else ""
                msg = RunEpisode(
                    f"train{iteration}-{index}{suffix}", iteration, "train", 0, f"train{position}",
                    train_problems[position], seed, version, drawn[position] * copies,
                )  # fmt: skip
                yield EpisodeTask(msg)
    if evaluate:
        players = [("eval", "eval")] + [(f"baseline/{name}", f"baseline-{name}-") for name in baselines]
        for mode, prefix in players:
            copies = episodes_per_problem(config, "eval") * (1 if mode == "eval" else config.eval.baseline_draws)
            for index in range(min(config.eval.size, len(test_problems))):
                for copy in range(copies):
                    suffix = f"-{copy}" if copies > 1 else ""
                    msg = RunEpisode(
                        f"{prefix}{iteration}-{index}{suffix}", iteration, mode, 0, f"test{index}",
                        test_problems[index], index * 1000 + copy, version,
                    )  # fmt: skip
                    yield EpisodeTask(msg)
