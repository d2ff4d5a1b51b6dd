"""A policy's iteration that trained nothing, told apart from one that trained: one rule for the router (which
logs it, counts the iterations in a row and stops the run after `trainer.max_untrained_iterations`) and the
progress line (which says it beside the iteration).

A step trains nothing when no sample reached the policy's trainer, when no sample had a non-zero advantage
(every reward equal within each of its groups: a reward that is always 0, or a constant local reward), or when
its loss and gradient norm are exactly zero. Every metric of such a step looks like a healthy one's (a loss of
0, no error), so it is named here, with its likely cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mas_async.runtime.run_failed import RunFailed

CONVERGED_ENTROPY = 0.1
"""Below this mean next-token entropy (nats) a step whose samples all had zero advantage is read as converged."""
SAID_EVERY = 10
"""The progress line says a policy trained nothing at the first iteration of a run of them and every tenth."""


class NothingTrained(RunFailed):
    """A policy trained nothing for `trainer.max_untrained_iterations` training iterations in a row."""


def why_untrained(metrics: Mapping[str, Any]) -> str | None:
    """Why the step whose metrics (a trainer's, merged over its ranks) are `metrics` trained nothing, or None when
    it trained something (or its figures cannot tell)."""
    samples = metrics.get("samples")
    if samples == 0:
        return "no sample reached its trainer (every episode dropped, or its agents never acted)"
    active = metrics.get("active_samples")
    entropy = metrics.get("entropy")
    if active == 0 and isinstance(entropy, (int, float)) and entropy < CONVERGED_ENTROPY:
        return (
            f"none of its {samples} samples had a non-zero advantage: its candidates agree (entropy {entropy:.3f} "
            "nats), it has converged on these problems"
        )
    if active == 0:
        reward = metrics.get("reward_mean")
        mean = f" (mean reward {reward:.3g})" if isinstance(reward, (int, float)) else ""
        return (
            f"none of its {samples} samples had a non-zero advantage: every reward was equal within each group"
            f"{mean}; make the reward vary between a group's candidates (a local reward, partial credit) or the "
            "task easier, and check that each group holds more than one sample"
        )
    if metrics.get("loss") == 0 and metrics.get("grad_norm") == 0:
        return "its loss and gradient norm were exactly 0"
    return None


def untrained_policies(row: Mapping[str, Any], policies: list[str]) -> dict[str, str]:
    """policy -> why it trained nothing, of those of `policies` whose step is in the metrics `row`
    (`policy/<p>/...`, as the router writes them)."""
    out = {}
    for policy in policies:
        prefix = f"policy/{policy}/"
        metrics = {key.removeprefix(prefix): value for key, value in row.items() if key.startswith(prefix)}
        if "samples" in metrics and (why := why_untrained(metrics)) is not None:
            out[policy] = why
    return out


def due_to_say(row: Mapping[str, Any], policy: str) -> bool:
    """Whether the progress line says again that `policy` trained nothing: the first iteration of a run of them
    and every `SAID_EVERY`-th (`policy/<p>/untrained_iterations`; always where the row has no count)."""
    streak = row.get(f"policy/{policy}/untrained_iterations")
    return not isinstance(streak, int) or streak <= 1 or streak % SAID_EVERY == 0


class UntrainedWatch:
    """The training iterations in a row in which each policy trained nothing; `NothingTrained` at `limit` (0: never)
    for a policy that has trained nothing yet in the run. One that trained before and now trains nothing has
    converged (its K candidates agree: the demo's movers do after a few hundred iterations) or lost its signal:
    said on the progress line at every such iteration, never stopped. A resumed run (`fresh` false) has trained."""

    def __init__(self, limit: int, fresh: bool = True) -> None:
        self.limit = limit
        self.fresh = fresh
        self.streak: dict[str, int] = {}
        self.trained: set[str] = set()
        """Policies that trained something in this run (or all of them, in a resumed run)."""

    def observe(self, trained: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        """Count an iteration's steps (policy -> its merged metrics); returns policy -> why it trained nothing."""
        untrained = {}
        for policy, metrics in trained.items():
            why = why_untrained(metrics)
            self.streak[policy] = self.streak.get(policy, 0) + 1 if why is not None else 0
            if why is not None:
                untrained[policy] = why
            else:
                self.trained.add(policy)
        return untrained

    def check(self, iteration: int, untrained: Mapping[str, str]) -> None:
        """`NothingTrained` when a policy of `untrained` (`observe`'s answer for iteration `iteration`) has now
        trained nothing for `limit` iterations in a row, and nothing before them in this run."""
        for policy, why in untrained.items():
            if self.limit and self.fresh and policy not in self.trained and self.streak[policy] >= self.limit:
                raise NothingTrained(
                    f"policy {policy!r} trained nothing for {self.streak[policy]} iterations in a row "
                    f"(to iteration {iteration}): {why}. Set trainer.max_untrained_iterations=0 to go on regardless"
                )
