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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mas_async.training.advantages import compute_advantages
from mas_async.wire.samples import Sample

if TYPE_CHECKING:
    from mas_async.training.learner import PolicyLearner

log = logging.getLogger("mas_async.trainer")


class StreamingStep:
    """One policy's step from weights `version`, computed as the iteration's episodes come in.

    `add` and `finish` run on the trainer's event loop; the compute passes run one at a time on the
    step's own thread (a one-worker executor, so they never overlap each other or the finish)."""

    def __init__(self, learner: PolicyLearner, version: int) -> None:
        self.learner = learner
        self.version = version
        self.waiting: dict[str, list[Sample]] = defaultdict(list)
        """problem id -> its samples so far, until every episode of the problem is in."""
        self.episodes: dict[str, set[str]] = defaultdict(set)
        """problem id -> the episodes of it that came in."""
        self.ready: list[Sample] = []
        """Samples of complete problems, for the next compute pass (shared with the thread: `_lock`)."""
        self.given = 0
        """Samples given (`add`) and not withdrawn."""
        self.withdrawn: set[int] = set()
        """ids of the samples withdrawn (`withdraw`)."""
        self.redo = False
        """A withdrawn sample may have been computed: `finish` computes the step again from the others."""
        self.samples: list[Sample] = []
        """Every sample computed, in the order of its pass (for the step's metrics)."""
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
        self.completed: list[tuple[float, int]] = []
        """(when, samples) of each problem as its last episode came in (time.monotonic())."""
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"stream-v{version}")
        self._passes: list[Future] = []
        learner.optimizer.zero_grad(set_to_none=True)

    # -- the event loop's side ---------------------------------------------------------------------

    def add(self, samples: list[Sample], episode_id: str, problem_episodes: int) -> None:
        """Take one episode's samples (all of this policy's, each of the step's version and policy), final:
        its EpisodeDone of the same attempt has come. `problem_episodes`: how many episodes of the iteration
        run its problem. A complete problem goes to the compute pass that runs next."""
        if not samples:
            return
        self.last_arrival = now = time.monotonic()
        self.given += len(samples)
        complete = []
        for problem in dict.fromkeys(s.problem_id for s in samples):
            self.waiting[problem] += [s for s in samples if s.problem_id == problem]
            self.episodes[problem].add(episode_id)
            if len(self.episodes[problem]) >= problem_episodes:
                done = self.waiting.pop(problem)
                complete += done
                self.completed.append((now, len(done)))
        if complete:
            with self._lock:
                self.ready += complete
            self._passes.append(self._thread.submit(self._pass))
            self._passes[-1].add_done_callback(_log_failure)

    def withdraw(self, samples: list[Sample]) -> None:
        """Take back samples given earlier (their episode's attempt failed or was abandoned after its groups
        streamed in). Those no pass took yet are dropped; if a pass may have computed one, `finish` computes
        the step again from the samples that stay (exact, at the cost of one batch step's compute)."""
        gone = {id(s) for s in samples} - self.withdrawn
        if not gone:
            return
        self.withdrawn |= gone
        self.given -= len(gone)
        dropped = 0
        with self._lock:
            before = len(self.ready)
            self.ready = [s for s in self.ready if id(s) not in gone]
            dropped += before - len(self.ready)
        for problem in list(self.waiting):
            before = len(self.waiting[problem])
            self.waiting[problem] = [s for s in self.waiting[problem] if id(s) not in gone]
            dropped += before - len(self.waiting[problem])
        if dropped < len(gone):  # the others were taken by a pass
            self.redo = True
            log.warning("step from v%d: %d withdrawn samples were computed; the step is computed again at its end",
                        self.version, len(gone) - dropped)  # fmt: skip

    async def drain(self) -> None:
        """Wait for the compute passes under way (re-raising a failure of theirs)."""
        while self._passes:
            await asyncio.wrap_future(self._passes.pop(0))

    async def finish(self, extra: list[Sample] = ()) -> dict[str, Any]:
        """The step, after the iteration's last episode: the samples not computed yet (and `extra`, admitted
        samples that were never given), the normaliser, one all-reduce, the optimiser step. Returns the
        step's metrics (`PolicyLearner.step`'s keys)."""
        await self.drain()
        rest = [s for problem in list(self.waiting) for s in self.waiting.pop(problem)]  # a dropped episode's
        self.given += len(extra)
        try:
            start = time.monotonic()
            metrics = await asyncio.wrap_future(self._thread.submit(self._finish, [*rest, *extra]))
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
            self._compute(chunk)
            self.busy.append((start, time.monotonic()))
            log.debug(
                "step from v%d: a pass over %d samples in %.2fs", self.version, len(chunk), self.busy[-1][1] - start
            )

    def _compute(self, chunk: list[Sample]) -> None:
        """Forward and backward of complete problems' samples; the gradients (of sums) accumulate locally."""
        learner, algo = self.learner, self.learner.algo
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
        self.entropy += entropy
        self.advantages.append(advantages)

    def _finish(self, chunk: list[Sample]) -> dict[str, Any]:
        with self._lock:
            chunk, self.ready = self.ready + chunk, []
        if self.redo:  # start again from the weights v: the passes' gradients held a withdrawn sample's
            chunk = [s for s in self.samples if id(s) not in self.withdrawn] + chunk
            self._reset()
        if chunk:
            self._compute(chunk)
        learner = self.learner
        assert len(self.samples) == self.given, "a streamed step computes each sample it is given, once"
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
            if learner.dp is not None:
                learner._zero_backward()  # outside no_sync: the one all-reduce of the accumulated gradients
            max_norm = learner.cfg.trainer.grad_clip or float("inf")
            self.stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(learner.model.parameters(), max_norm))
            learner.optimizer.step()
        learner.scheduler.step()
        diffs = torch.cat(self.diffs) if self.diffs else torch.zeros(0)
        advantages = np.concatenate(self.advantages) if self.advantages else np.zeros(0)
        return learner._step_metrics(
            self.samples, advantages, self.stats, 1, self.active, self.computed_tokens, diffs, self.entropy
        )  # fmt: skip

    def _reset(self) -> None:
        """Forget every pass: no gradient, no sample computed."""
        self.learner.optimizer.zero_grad(set_to_none=True)
        self.samples, self.advantages, self.diffs, self.entropy = [], [], [], []
        self.stats = self.learner._new_stats()
        self.active = self.computed_tokens = 0

    def timing(self) -> dict[str, float]:
        """Seconds of compute in all (`time/compute_s`) and before the last samples came in
        (`time/early_compute_s`): the share of the step that overlapped the rollout. And what bounds that
        share: the samples whose problem was complete before the last samples came in
        (`time/ready_early_samples`, of `time/given_samples`: no pass could take the others earlier) and
        how long before them the first problem was (`time/ready_lead_s`)."""
        total = sum(end - start for start, end in self.busy)
        early = sum(max(0.0, min(end, self.last_arrival) - start) for start, end in self.busy)
        ready = [(when, count) for when, count in self.completed if when < self.last_arrival]
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
