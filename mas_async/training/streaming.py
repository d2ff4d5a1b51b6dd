"""The strict step computed while the rollouts run (`trainer.streaming`; DESIGN.md section 13).

With one optimiser step per iteration (`ppo_epochs` and `mini_batches` 1) at fixed weights v, the step's
gradient is a sum over samples:

    g = (1 / N) * sum_i sum_t grad loss_{i,t}

and every term can be computed before the iteration's last episode is in:
- sample i's advantage is relative to its problem's samples only: every statistic of `advantages.py`
  (a group's mean and std, Dr. MAS's per-agent sigma_k of `std_scope: agent`, the `agent` and
  `trajectory` groupings' means and stds) is keyed by problem. So a problem's advantages are final once
  every episode that runs it in this iteration is in (`Groups.problem_episodes`: one under tree
  sampling, K under parallel sampling, more if the dataset is smaller than a batch), and its samples wait
  for that, not for the whole batch: no per-agent gradient accumulator, and no scale applied at the end;
- its old log-probs are those of the weights v, the same whenever they are computed (the training pass's
  own, or a no-grad recompute, as in `PolicyLearner.step`);
- N, the token-mean (or sequence-mean) normaliser, is a count over the policy's whole batch (over every
  rank): the backward runs on sums (normaliser 1) and the accumulated gradient is divided by N once.

`StreamingStep.add` (the trainer's event loop) takes each episode's samples as its Groups arrive (or each
group's as it is recorded, when groups stream by turn: `Config.streams_turns`, where a group's advantages
need no other sample) and hands every complete problem to a compute pass in a thread (forward and
backward; the gradients accumulate in `.grad`; with several ranks inside DDP's `no_sync`); no weight
changes. `finish` (at TrainStep, after the
iteration's last episode) computes what is left (a problem one of whose episodes was dropped: its
advantages are relative to the episodes that came, as in the batch step), divides by N, all-reduces
once (one zero-loss backward outside `no_sync`: DDP's reducer sums the accumulated gradients), clips,
steps the optimiser and the schedule. The update equals `PolicyLearner.step` on the same samples up to
float rounding (tests/unit/framework/test_streaming.py). A group streamed by turn whose episode's attempt
then fails is taken back (`withdraw`); if a pass had computed it, `finish` computes the step again from
the samples that stay.

A sample given to the step is known by what it is on the wire, its `SampleKey` (the episode and attempt of
the Groups message that brought it, its group, its place in that group), never by `id()`: a withdrawn
sample that no pass took is dropped and freed, and CPython gives its address to the next objects it makes,
typically the retry's samples (tests/unit/framework/test_streaming_withdrawals.py). At its end the step
checks that it computed exactly the samples it was given and not withdrawn, each once
(`StreamedStepError` otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from mas_async.devices import on_process_device
from mas_async.training.advantages import compute_advantages
from mas_async.wire.samples import Sample

if TYPE_CHECKING:
    from mas_async.training.learner import PolicyLearner

log = logging.getLogger("mas_async.trainer")

HELD = -1
"""The attempt of `finish`'s `extra` samples' keys: never given to the step, so never withdrawn from it."""


class StreamedStepError(RuntimeError):
    """A streamed step was given a sample it may not train, or did not compute each sample it was given (and
    not withdrawn) exactly once: its update would not be the batch step's."""


class SampleKey(NamedTuple):
    """What a sample given to a streamed step is, whatever object holds it: the episode and attempt of the
    Groups message that brought it (`Groups.episode_id`, `Groups.attempt`), its group key (`Sample.group`:
    episode, agent, turn) and its place among that group's samples that the message gave the step. An
    attempt's groups come once each (the router forwards each Groups of the current attempt once), so keys
    are unique; a withdrawal names the keys of what was given, and a retry (attempt + 1) never shares one."""

    episode_id: str
    attempt: int
    group: str
    index: int


def sample_keys(samples: Iterable[Sample], episode_id: str, attempt: int) -> list[SampleKey]:
    """The keys of one Groups message's samples (of episode `episode_id`, attempt `attempt`), in order."""
    seen: Counter[str] = Counter()
    keys = []
    for sample in samples:
        keys.append(SampleKey(episode_id, attempt, sample.group, seen[sample.group]))
        seen[sample.group] += 1
    return keys


class StreamingStep:
    """One policy's step from weights `version`, computed as the iteration's episodes come in.

    `add` and `finish` run on the trainer's event loop; the compute passes run one at a time on the
    step's own thread (a one-worker executor, so they never overlap each other or the finish). Once the
    tail begins (`begin_tail`: the step's TrainStep came), what is left to compute (from the next run of
    whole problems of a pass under way, `_pieces`) and the finish run on `tail_threads` torch threads
    (None: the thread's own, `cluster.torch_threads`)."""

    def __init__(self, learner: PolicyLearner, version: int, tail_threads: int | None = None) -> None:
        self.learner = learner
        self.version = version
        self.tail_threads = tail_threads
        self.tail = False
        """The step's TrainStep came: nothing of its rollout runs any more (`begin_tail`)."""
        self.waiting: dict[str, list[tuple[SampleKey, Sample]]] = defaultdict(list)
        """problem id -> its samples so far (with their keys), until every episode of the problem is in."""
        self.episodes: dict[str, set[str]] = defaultdict(set)
        """problem id -> the episodes of it that came in."""
        self.ready: list[tuple[SampleKey, Sample]] = []
        """Samples of complete problems, for the next compute pass (shared with the thread: `_lock`)."""
        self.given_keys: Counter[SampleKey] = Counter()
        """The keys of the samples given (`add`, `finish`'s `extra`) and not withdrawn: what the step computes."""
        self.withdrawn: set[SampleKey] = set()
        """The keys of the samples withdrawn (`withdraw`): a pass that took one computed a sample to forget."""
        self.redo = False
        """A withdrawn sample may have been computed: `finish` computes the step again from the others."""
        self.samples: list[Sample] = []
        """Every sample computed, in the order of its pass (for the step's metrics)."""
        self.keys: list[SampleKey] = []
        """The key of each sample of `samples`, in its order."""
        self.advantages: list[np.ndarray] = []
        self.diffs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor | None] = []
        """Each computed sample's measured entropies (its first pass's), in `samples`' order."""
        self.stats = learner._new_stats()
        self.active = 0
        self.computed_tokens = 0
        self.busy: list[tuple[float, float]] = []
        """(start, end) of every compute pass and of the finish, time.monotonic()."""
        self.last_arrival = 0.0
        """When the last samples came in (time.monotonic(); 0 if none did)."""
        self.completed: list[tuple[float, list[SampleKey]]] = []
        """(when, the keys of its samples) of each problem as its last episode came in (time.monotonic()); a
        withdrawn sample's key stays, and `timing` leaves it out."""
        self.discarded: list[tuple[float, float]] = []
        """(start, end) of the passes whose work a withdrawal threw away (`_reset` before the step's redo)."""
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"stream-v{version}")
        self._passes: list[Future] = []
        learner.optimizer.zero_grad(set_to_none=True)

    @property
    def given(self) -> int:
        """How many samples were given (`add`, `finish`'s `extra`) and not withdrawn."""
        return self.given_keys.total()

    # -- the event loop's side ---------------------------------------------------------------------

    def add(self, samples: list[Sample], episode_id: str, problem_episodes: int, attempt: int = 0) -> None:
        """Take one Groups message's samples (of episode `episode_id`'s attempt `attempt`; all of this policy's,
        each of the step's version and policy): an episode's, final once its EpisodeDone of the same attempt
        has come, or one group streamed by turn (`withdraw` takes it back if the attempt fails).
        `problem_episodes`: how many episodes of the iteration run its problem. A complete problem goes to
        the compute pass that runs next. StreamedStepError for a sample of another version (the trainer gives
        the step only those its version rule admits)."""
        if not samples:
            return
        self._check_trainable(samples)
        self.last_arrival = now = time.monotonic()
        keyed = list(zip(sample_keys(samples, episode_id, attempt), samples, strict=True))
        self.given_keys.update(key for key, _ in keyed)
        complete = []
        for problem in dict.fromkeys(s.problem_id for s in samples):
            self.waiting[problem] += [(key, s) for key, s in keyed if s.problem_id == problem]
            self.episodes[problem].add(episode_id)
            if len(self.episodes[problem]) >= problem_episodes:
                done = self.waiting.pop(problem)
                complete += done
                self.completed.append((now, [key for key, _ in done]))
        if complete:
            with self._lock:
                self.ready += complete
            self._passes.append(self._thread.submit(on_process_device(self._pass)))
            self._passes[-1].add_done_callback(_log_failure)

    def _check_trainable(self, samples: list[Sample]) -> None:
        """Strict mode's rule, checked again where it matters: a sample of other weights than v never enters
        the step's gradient (the trainer refuses and counts those before, `Trainer.admit`)."""
        wrong = sorted({s.version for s in samples if s.version != self.version})
        if wrong:
            raise StreamedStepError(
                f"the streamed step from v{self.version} was given samples of versions {wrong}: the version rule "
                "refuses and counts them, they never reach the step"
            )

    def withdraw(self, episode_id: str, attempt: int) -> int:
        """Take back the samples given of episode `episode_id`'s attempt `attempt` (it failed or was abandoned
        after its groups streamed in); returns how many. Those no pass took yet are dropped; if a pass may have
        computed one, `finish` computes the step again from the samples that stay (exact, at the cost of one
        batch step's compute)."""
        gone = {key for key in self.given_keys if key.episode_id == episode_id and key.attempt == attempt}
        if not gone:
            return 0
        self.withdrawn |= gone
        count = sum(self.given_keys.pop(key) for key in gone)
        dropped = 0
        with self._lock:
            before = len(self.ready)
            self.ready = [(key, s) for key, s in self.ready if key not in gone]
            dropped += before - len(self.ready)
        for problem in list(self.waiting):
            before = len(self.waiting[problem])
            self.waiting[problem] = [(key, s) for key, s in self.waiting[problem] if key not in gone]
            dropped += before - len(self.waiting[problem])
        if dropped < count:  # the others were taken by a pass
            self.redo = True
        log.warning(
            "step from v%d: withdrew %d samples of episode %s (attempt %d): %d dropped before a pass took them, "
            "%d taken by a pass%s", self.version, count, episode_id, attempt, dropped, count - dropped,
            " (the step is computed again at its end)" if dropped < count else "",
        )  # fmt: skip
        return count

    def begin_tail(self) -> None:
        """The iteration's last episode is in: what is left to compute (a pass under way from its next run of
        problems on) and the finish take `tail_threads` torch threads."""
        self.tail = True

    async def drain(self) -> None:
        """Wait for the compute passes under way (re-raising a failure of theirs)."""
        while self._passes:
            await asyncio.wrap_future(self._passes.pop(0))

    async def finish(self, extra: list[Sample] = ()) -> dict[str, Any]:
        """The step, after the iteration's last episode: the samples not computed yet (and `extra`, admitted
        samples that were never given), the normaliser, one all-reduce, the optimiser step. Returns the
        step's metrics (`PolicyLearner.step`'s keys). The tail begins here if `begin_tail` did not begin it."""
        self.begin_tail()
        await self.drain()
        rest = [keyed for problem in list(self.waiting) for keyed in self.waiting.pop(problem)]  # a dropped episode's
        if extra:
            self._check_trainable(list(extra))
        held = [(SampleKey(s.episode_id, HELD, s.group, i), s) for i, s in enumerate(extra)]
        self.given_keys.update(key for key, _ in held)
        try:
            start = time.monotonic()
            metrics = await asyncio.wrap_future(self._thread.submit(on_process_device(self._finish), [*rest, *held]))
            self.busy.append((start, time.monotonic()))
        finally:
            self._thread.shutdown(wait=False)
        return {**metrics, **self.timing()}

    # -- the compute thread's side -----------------------------------------------------------------

    def _pass(self) -> None:
        """One compute pass over every sample that is ready when it begins (none: a later add's pass began
        first and took them)."""
        with self._lock:
            chunk, self.ready = self.ready, []
        if chunk:
            start = time.monotonic()
            for piece in self._pieces(chunk):
                with self._threads():
                    self._compute(piece)
            self.busy.append((start, time.monotonic()))
            log.debug(
                "step from v%d: a pass over %d samples in %.2fs", self.version, len(chunk), self.busy[-1][1] - start
            )

    def _compute(self, keyed: list[tuple[SampleKey, Sample]]) -> None:
        """Forward and backward of complete problems' samples; the gradients (of sums) accumulate locally."""
        learner, algo = self.learner, self.learner.algo
        chunk = [s for _, s in keyed]
        advantages = compute_advantages(chunk, algo.grouping, algo.eps, algo.normalize_std, algo.std_scope)
        trained, old, ref, rollout, entropy = learner._pass_inputs(chunk, advantages)
        recomputed = old
        if algo.old_logprobs == "rollout":
            old = rollout
        chosen = [i for i in range(len(chunk)) if trained[i]]
        if chosen:
            self.computed_tokens += learner._accumulate(
                chunk, chosen, advantages, old, ref, 1.0, self.stats, None, entropy, sync=False
            )  # fmt: skip
        self.active += len(chosen)
        self.diffs += learner._fresh_diffs(chunk, recomputed, rollout, self.version)
        self.samples += chunk
        self.keys += [key for key, _ in keyed]
        self.entropy += entropy
        self.advantages.append(advantages)

    def _finish(self, chunk: list[tuple[SampleKey, Sample]]) -> dict[str, Any]:
        with self._threads():
            return self._finish_step(chunk)

    def _pieces(self, keyed: list[tuple[SampleKey, Sample]]) -> list[list[tuple[SampleKey, Sample]]]:
        """A pass's samples in runs of whole problems (a problem's advantages need only its own samples) of
        about `trainer.micro_batch_sequences` each, so that a pass under way when the tail begins takes
        `tail_threads` from its next run on (one run without `tail_threads`)."""
        if not self.tail_threads:
            return [keyed]
        size = self.learner.cfg.trainer.micro_batch_sequences
        problems: dict[str, list[tuple[SampleKey, Sample]]] = defaultdict(list)
        for key, sample in keyed:
            problems[sample.problem_id].append((key, sample))
        pieces: list[list[tuple[SampleKey, Sample]]] = [[]]
        for samples in problems.values():
            if len(pieces[-1]) >= size:
                pieces.append([])
            pieces[-1] += samples
        return pieces

    @contextmanager
    def _threads(self) -> Iterator[None]:
        """In the tail, this (compute) thread's torch threads are `tail_threads`, then as they were."""
        if not (self.tail and self.tail_threads):
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.tail_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _finish_step(self, chunk: list[tuple[SampleKey, Sample]]) -> dict[str, Any]:
        with self._lock:
            chunk, self.ready = self.ready + chunk, []
        if self.redo:  # start again from the weights v: the passes' gradients held a withdrawn sample's
            kept = [(key, s) for key, s in zip(self.keys, self.samples, strict=True) if key not in self.withdrawn]
            chunk = kept + chunk
            self._reset()
        if chunk:
            self._compute(chunk)
        self._check_computed()
        learner = self.learner
        tokens = sum(len(s.completion_ids) for s in self.samples)
        tokens, sequences, active = learner._global([tokens, len(self.samples), self.active])
        if sequences == 0:
            return {"samples": 0}
        normalizer = max(float(tokens if learner.algo.loss_agg == "token_mean" else sequences), 1.0)
        for key in ("loss", "kl"):
            self.stats[key] /= normalizer
        if active:
            # Each rank's gradient is of its loss sums times the ranks (`_micro_step`); DDP's all-reduce
            # takes their mean, so dividing by the global N first gives the batch step's gradient.
            for p in learner.model.parameters():
                if p.grad is not None:
                    p.grad.div_(normalizer)
            if learner.ddp is not learner.model:  # (the distributed optimiser reduces them at its step)
                learner._zero_backward()  # outside no_sync: the one all-reduce of the accumulated gradients
            learner.optimizer_step(self.stats)  # clip, step, count what changed
        learner.scheduler.step()
        learner.refresh_served()
        diffs = torch.cat(self.diffs) if self.diffs else torch.zeros(0)
        advantages = np.concatenate(self.advantages) if self.advantages else np.zeros(0)
        return learner._step_metrics(
            self.samples, advantages, self.stats, 1, self.active, self.computed_tokens, diffs, self.entropy
        )  # fmt: skip

    def _check_computed(self) -> None:
        """Each sample given and not withdrawn computed once, and nothing else (a real check, not an assert:
        under `python -O` a wrong step would train silently)."""
        computed = Counter(self.keys)
        if computed != self.given_keys:
            never, surplus = self.given_keys - computed, computed - self.given_keys
            raise StreamedStepError(
                f"the streamed step from v{self.version} computed {len(self.keys)} samples, but was given "
                f"{self.given} (not withdrawn): {never.total()} given were never computed (e.g. {list(never)[:2]}), "
                f"{surplus.total()} computed were not given or computed twice (e.g. {list(surplus)[:2]})"
            )

    def _reset(self) -> None:
        """Forget every pass: no gradient, no sample computed (their time is kept as `discarded`)."""
        self.learner.optimizer.zero_grad(set_to_none=True)
        self.discarded += self.busy
        self.busy = []
        self.samples, self.keys, self.advantages, self.diffs, self.entropy = [], [], [], [], []
        self.stats = self.learner._new_stats()
        self.active = self.computed_tokens = 0

    def timing(self) -> dict[str, float]:
        """Seconds of compute in all (`time/compute_s`) and before the last samples came in
        (`time/early_compute_s`): the share of the step that overlapped the rollout. And what bounds that
        share: the samples whose problem was complete before the last samples came in
        (`time/ready_early_samples`, of `time/given_samples`: no pass could take the others earlier) and
        how long before them the first problem was (`time/ready_lead_s`). The compute counts every pass, those a
        withdrawal threw away too (their time was spent); the early compute and the ready samples count only what
        the step kept: a withdrawn sample, or a pass computed again, is not overlap."""
        total = sum(end - start for start, end in [*self.discarded, *self.busy])
        early = sum(max(0.0, min(end, self.last_arrival) - start) for start, end in self.busy)
        ready = [
            (when, sum(key not in self.withdrawn for key in keys))
            for when, keys in self.completed
            if when < self.last_arrival
        ]
        ready = [(when, count) for when, count in ready if count]
        return {
            "time/compute_s": total,
            "time/early_compute_s": early,
            "time/given_samples": self.given,
            "time/ready_early_samples": sum(count for _, count in ready),
            "time/ready_lead_s": self.last_arrival - ready[0][0] if ready else 0.0,
        }


def _log_failure(future: Future) -> None:
    """A failed compute pass is logged at once; the step that awaits it (`drain`, `finish`) re-raises it."""
    if not future.cancelled() and future.exception() is not None:
        log.error("a streamed compute pass failed: %r", future.exception())


def overlap_metrics(per_rank: list[dict[str, Any]], sent_at: float) -> dict[str, float]:
    """A step's overlap with its rollout, from every rank's metrics (streamed or not):
    `trainer/compute_s`, the seconds of the step's compute (summed over the ranks), `trainer/overlap`, the
    share of them done before each rank's last samples came in, and `trainer/tail_s`, from the iteration's
    last Groups message (to any rank; wall clock) to `sent_at`, when the weights were sent. A streamed step
    adds what bounds its overlap: `trainer/ready_early`, the share of its samples whose problem was complete
    before the rank's last samples came in, and `trainer/ready_lead_s`, how long before them the first one
    was (the most of the ranks). Left out where not measured (no compute: a step without samples; no Groups
    in the iteration; a batch step)."""
    out: dict[str, float] = {}
    total = sum(m["time/compute_s"] for m in per_rank if "time/compute_s" in m)
    if total > 0:
        out["trainer/compute_s"] = total
        out["trainer/overlap"] = sum(m["time/early_compute_s"] for m in per_rank if "time/compute_s" in m) / total
    streamed = [m for m in per_rank if m.get("time/given_samples")]
    if streamed:
        given = sum(m["time/given_samples"] for m in streamed)
        out["trainer/ready_early"] = sum(m["time/ready_early_samples"] for m in streamed) / given
        out["trainer/ready_lead_s"] = max(m["time/ready_lead_s"] for m in streamed)
    last = [m["last_group_at"] for m in per_rank if "last_group_at" in m]
    if last:
        out["trainer/tail_s"] = sent_at - max(last)
    return out
