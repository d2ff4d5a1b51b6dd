"""One metrics row per iteration, built by the router from its episode book and the trainers' metrics.

Key names are those of `mas_async.metrics.Keys`. Success rates count every episode that was dispatched:
a failed or timed-out episode is a failure, never left out of the denominator (`*/dropped` says how
many there were). A figure that nothing measured in the iteration is left out of the row, never
written as 0.0 (a trainer's metrics are its own: see training/learner.py). The row of the run's first
evaluation also holds the env's reference policies on the same problems: eval/baseline/<name>/...
"""

from __future__ import annotations

from typing import Any

from mas_async.metrics import REFUSED_AUTH, EpisodeStats, Keys
from mas_async.router.episodes import MODES, EpisodeBook

PER_AGENT = ("reward/", Keys.PARSE_PREFIX, Keys.PROGRESS_PREFIX, Keys.GATEWAY_PREFIX)
"""Prefixes of the per-agent means of episode summaries that a row reports."""


def iteration_row(
    book: EpisodeBook,
    *,
    eval_k: int,
    train: bool,
    trained: dict[str, dict[str, Any]],
    version: int,
    rollout_s: float,
    step_s: float,
    malformed: int,
    refused_messages: int,
    refused_handshakes: int,
    elapsed_s: float,
) -> dict[str, Any]:
    row: dict[str, Any] = {Keys.ITERATION: book.iteration}
    train_stats, eval_stats = book.stats["train"], book.stats["eval"]
    if train:
        means = train_stats.means()
        row[Keys.TRAIN_SUCCESS] = book.success_rate("train")
        for key, value in means.items():
            if key.startswith(PER_AGENT):
                row[key] = value
        row[Keys.TRAIN_EPISODES] = train_stats.episodes
        row[Keys.TRAIN_DROPPED] = book.dropped["train"]
        if "turns" in means:  # (no episode finished: every one was dropped)
            row[Keys.TRAIN_TURNS] = means["turns"]
        row[Keys.MULTI_VERSION] = train_stats.multi_version_tokens / max(1, train_stats.tokens)
    if eval_stats.episodes or book.dropped["eval"]:
        means = eval_stats.means()
        ran = eval_stats.episodes + book.dropped["eval"]
        success = book.success_rate("eval")
        row[Keys.EVAL_SUCCESS] = success
        row[f"eval/avg@{eval_k}"] = success
        solved = book.eval_solved.values()
        problems = max(1, ran // max(1, eval_k))
        row[f"eval/pass@{eval_k}"] = sum(any(s) for s in solved) / problems
        for key, value in means.items():
            if key.startswith(PER_AGENT):
                row[f"eval/{key}"] = value
        row[Keys.EVAL_EPISODES] = eval_stats.episodes
        row[Keys.EVAL_DROPPED] = book.dropped["eval"]
    for mode, stats in book.stats.items():
        if mode not in MODES:
            row.update(baseline_figures(mode.removeprefix("baseline/"), stats, book.dropped[mode]))
    tokens = train_stats.tokens + eval_stats.tokens
    row[Keys.TOKENS_PER_S] = tokens / rollout_s if rollout_s > 0 else 0.0
    row[Keys.ROLLOUT_S] = rollout_s
    if train:
        for key in (Keys.TRAIN_S, Keys.WEIGHT_SYNC_S):
            times = [m[key] for m in trained.values() if key in m]
            if times:
                row[key] = max(times)
        row[Keys.STEP_S] = step_s
        for policy, metrics in trained.items():
            row[Keys.policy(policy, "version")] = version
            for key, value in metrics.items():
                if key.startswith("trainer/"):  # the step's overlap with the rollout (training/streaming.py)
                    row[Keys.trainer(policy, key.removeprefix("trainer/"))] = value
                elif not key.startswith("time/"):
                    row[Keys.policy(policy, key)] = value
    refused = [stats.sums[REFUSED_AUTH] for stats in book.stats.values() if REFUSED_AUTH in stats.counts]
    if refused:  # (only runs whose gateways are external count them)
        row[Keys.GATEWAY_REFUSED_AUTH] = sum(refused)
    row[Keys.LATE_GROUPS] = book.late
    row[Keys.MALFORMED] = malformed
    row[Keys.REFUSED_MESSAGES] = refused_messages
    row[Keys.REFUSED_HANDSHAKES] = refused_handshakes
    row[Keys.ELAPSED_S] = elapsed_s
    return row


def baseline_figures(name: str, stats: EpisodeStats, dropped: int) -> dict[str, Any]:
    """Reference policy `name`'s figures on the held-out problems, as eval/baseline/<name>/... keys: its
    team success rate (a dropped episode is a failure), the per-agent means, episodes and dropped."""
    ran = stats.episodes + dropped
    figures = {Keys.baseline(name, "team_success_rate"): stats.sums.get("success", 0.0) / max(1, ran)}
    for key, value in stats.means().items():
        if key.startswith(PER_AGENT):
            figures[Keys.baseline(name, key)] = value
    figures[Keys.baseline(name, "episodes")] = stats.episodes
    figures[Keys.baseline(name, "dropped")] = dropped
    return figures
