"""The metrics reference: every key a run can write to RUN_DIR/metrics.jsonl (and TensorBoard, W&B), its
meaning, its unit and when it is in a row.

One table, `METRICS`, kept beside the code that writes the rows (mas_async/metrics.py `Keys`, router/report.py,
the trainer's step metrics); docs/reference/metrics.md is rendered from it (`metrics_markdown`), and every
integration test's run checks that each key its rows hold matches an entry here (`undocumented`), so a key
added without a line here fails the tests. A key that a row does not hold was not measured in that
iteration: it is never written as 0.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Metric:
    """One key, or a family of keys with the user's own names in <angle brackets>."""

    key: str
    """E.g. `policy/<policy>/loss`; <policy>, <agent>, <name>, <role>, <k> and <ms> stand for one path part."""
    unit: str
    """count, share (0..1), s, ms, bytes, tokens, tokens/s, nats, a reward's own unit, or - (a number without one)."""
    meaning: str
    present: str
    """When a row holds it."""


EVERY = "every row"
TRAINING = "rows of training iterations"
EVAL = "rows with a held-out evaluation (every `eval.every` iterations, and the last)"
STEP = "rows of training iterations (the policy's trainer stepped)"

GATEWAY_COUNTS = {
    "calls": "every call",
    "in_process": "calls made in the env worker's process (no HTTP)",
    "fresh": "calls whose history held none of the agent's replies, tokenised afresh: its first call, a new "
    "conversation, or a client that dropped its replies (the Agents SDK drops an empty one)",
    "reused": "calls whose history's earlier turns reused the recorded token ids",
    "prefix_mismatch": "calls whose history diverged from the recorded one (edited), the prompt tokenised anew",
    "retokenized": "calls whose history the gateway had to tokenise again",
}
"""The gateway's per-agent counts (mas_async/gateway/episode.py)."""

METRICS: tuple[Metric, ...] = (
    Metric("iteration", "count", "The iteration (0-based); the row's step in TensorBoard and W&B.", EVERY),
    # -- the rollout --------------------------------------------------------------------------------------------
    Metric(
        "team/success_rate",
        "share",
        "Training episodes whose env says success (a dropped one fails), after tree sampling's best-of-K commits.",
        TRAINING,
    ),  # fmt: skip
    Metric(
        "reward/<agent>",
        "reward",
        "The agent's mean reward per candidate (alpha * team + local), over the iteration's training episodes.",
        TRAINING + " where the agent acted",
    ),  # fmt: skip
    Metric(
        "parse/invalid_rate/<agent>",
        "share",
        "Candidates of the agent whose reply did not parse (a penalty reward), mean over the episodes.",
        TRAINING + " where the agent acted",
    ),  # fmt: skip
    Metric(
        "progress_rate/<agent>",
        "share",
        "Committed moves of the agent the env judged good (`Env.move_quality`, e.g. Plan-Path: closer to the goal).",
        TRAINING + ", envs that judge moves",
    ),  # fmt: skip
    *(
        Metric(
            f"gateway/{name}/<agent>",
            "count",
            f"An OpenAI API program's calls of the agent per episode: {what} (docs/gateway.md).",
            "runs of `workflow.program`",
        )  # fmt: skip
        for name, what in GATEWAY_COUNTS.items()
    ),
    Metric(
        "gateway/score/<agent>",
        "reward",
        "Tree sampling through the gateway: the mean score of the agent's candidates.",
        "runs of `workflow.program` with tree sampling",
    ),  # fmt: skip
    Metric(
        "gateway/refused_auth",
        "count",
        "Requests the run's external gateways refused for a missing or wrong run token in the iteration.",
        "runs with `gateway.external`",
    ),  # fmt: skip
    Metric("rollout/episodes", "count", "Training episodes that finished in the iteration.", TRAINING),
    Metric(
        "rollout/dropped",
        "count",
        "Training episodes dropped (timed out, failed, or poisoned): counted as failures in team/success_rate.",
        TRAINING,
    ),  # fmt: skip
    Metric(
        "rollout/poisoned",
        "count",
        "Episodes dropped because they ran on `rollout.max_attempts` lost env workers (also in rollout/dropped).",
        EVERY,
    ),  # fmt: skip
    Metric("rollout/turns", "count", "Turns per training episode, mean.", TRAINING + " where an episode finished"),
    Metric(
        "rollout/multi_version_token_fraction",
        "share",
        "Tokens of episodes whose completions came from more than one weight version (0 in strict mode).",
        TRAINING,
    ),  # fmt: skip
    Metric(
        "throughput/rollout_tokens_per_s",
        "tokens/s",
        "Completion tokens of the iteration's episodes over time/rollout_s.",
        EVERY,
    ),  # fmt: skip
    # -- held-out evaluation ------------------------------------------------------------------------------------
    Metric(
        "eval/team_success_rate",
        "share",
        "Held-out episodes (greedy unless `eval.temperature`) whose env says success; a dropped one fails.",
        EVAL,
    ),  # fmt: skip
    Metric("eval/avg@<k>", "share", "The same as eval/team_success_rate, named for `eval.k` samples a problem.", EVAL),
    Metric("eval/pass@<k>", "share", "Held-out problems solved by at least one of their `eval.k` episodes.", EVAL),
    Metric("eval/reward/<agent>", "reward", "reward/<agent> on the held-out episodes.", EVAL),
    Metric("eval/parse/invalid_rate/<agent>", "share", "parse/invalid_rate/<agent> held out.", EVAL),
    Metric("eval/progress_rate/<agent>", "share", "progress_rate/<agent> held out.", EVAL + ", envs that judge moves"),
    *(
        Metric(f"eval/gateway/{name}/<agent>", "count", f"gateway/{name}/<agent> held out.", EVAL + ", program runs")
        for name in GATEWAY_COUNTS
    ),
    Metric("eval/gateway/score/<agent>", "reward", "gateway/score/<agent> held out.", EVAL + ", program runs"),
    Metric("eval/episodes", "count", "Held-out episodes that finished.", EVAL),
    Metric("eval/dropped", "count", "Held-out episodes dropped (counted as failures).", EVAL),
    Metric(
        "eval/baseline/<name>/team_success_rate",
        "share",
        "The env's reference policy <name> (random, a "
        "constant answer, a rule, the optimum) on the same held-out problems: its expectation, exact where "
        "its choices can be enumerated, else drawn to a standard error of `eval.baseline_standard_error`.",
        "the row of the run's first evaluation (`eval.baselines`)",
    ),  # fmt: skip
    Metric(
        "eval/baseline/<name>/reward/<agent>",
        "reward",
        "A reference policy's reward/<agent>.",
        "with the baselines' team success",
    ),  # fmt: skip
    Metric(
        "eval/baseline/<name>/parse/invalid_rate/<agent>",
        "share",
        "A reference policy's invalid replies.",
        "with the baselines' team success",
    ),  # fmt: skip
    Metric(
        "eval/baseline/<name>/progress_rate/<agent>",
        "share",
        "A reference policy's good moves.",
        "with the baselines' team success, envs that judge moves",
    ),  # fmt: skip
    Metric(
        "eval/baseline/<name>/episodes",
        "count",
        "A reference policy's finished episodes.",
        "with the baselines' team success",
    ),  # fmt: skip
    Metric(
        "eval/baseline/<name>/dropped",
        "count",
        "A reference policy's dropped episodes.",
        "with the baselines' team success",
    ),  # fmt: skip
    # -- time ---------------------------------------------------------------------------------------------------
    Metric(
        "time/rollout_s",
        "s",
        "The iteration's rollout, from its first dispatch (stale mode: from when its "
        "first episode could run) to its last episode's end.",
        EVERY,
    ),  # fmt: skip
    Metric(
        "time/train_s", "s", "The slowest trainer's step, from TrainStep to the new weights (less a checkpoint).", STEP
    ),  # fmt: skip
    Metric("time/weight_sync_s", "s", "The slowest trainer's weight broadcast to its servers.", STEP),
    Metric("time/step_s", "s", "The router's view of the step: TrainStep to every Trained and WeightsLoaded.", STEP),
    Metric("time/trainer_idle_s", "s", "How long the trainers waited for the rollout in the iteration.", EVERY),
    Metric(
        "time/inference_idle_s",
        "s",
        "How long no episode was generating in the iteration (the servers idle: a strict step, env-bound stretches).",
        EVERY,
    ),  # fmt: skip
    Metric("time/elapsed_s", "s", "Since the router started.", EVERY),
    # -- a policy's step (policy/<policy>/...) -------------------------------------------------------------------
    Metric("policy/<policy>/version", "count", "The weight version the iteration's samples were generated by.", STEP),
    Metric(
        "policy/<policy>/version_mismatch",
        "count",
        "Samples of another version the trainer refused: the strict on-policy proof, 0 in strict mode.",
        STEP,
    ),  # fmt: skip
    Metric(
        "policy/<policy>/logprob_abs_diff",
        "nats",
        "Mean |trainer's recomputed log-prob - server's| over the "
        "checked tokens: the proof that the servers ran the trainer's weights (~1e-7 in float32).",
        STEP + " where a rollout log-prob was checked",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/logprob_abs_diff_max",
        "nats",
        "The largest such difference.",
        STEP + " where a rollout log-prob was checked",
    ),  # fmt: skip
    Metric("policy/<policy>/samples", "count", "Samples (candidates) the step trained on.", STEP),
    Metric(
        "policy/<policy>/active_samples",
        "count",
        "Of them, those with a non-zero advantage (the others add "
        "nothing to the gradient); 0 means the step trained nothing (see untrained_iterations).",
        STEP,
    ),  # fmt: skip
    Metric(
        "policy/<policy>/untrained_iterations",
        "count",
        "Training iterations in a row in which the policy "
        "trained nothing (no sample, no non-zero advantage, or a zero loss and gradient); a policy that has "
        "trained nothing at all in the run stops it at `trainer.max_untrained_iterations`.",
        STEP,
    ),  # fmt: skip
    Metric("policy/<policy>/tokens", "tokens", "Completion tokens of the step's samples.", STEP),
    Metric(
        "policy/<policy>/loss",
        "-",
        "The PPO-clip objective (plus KL and entropy terms when on), over the step's normaliser (tokens or sequences).",
        STEP,
    ),  # fmt: skip
    Metric("policy/<policy>/lr", "-", "The learning rate after the step's schedule.", STEP),
    Metric(
        "policy/<policy>/optimizer_steps", "count", "Optimiser steps in the step (ppo_epochs x mini_batches).", STEP
    ),
    Metric("policy/<policy>/micro_batches", "count", "Forward/backward micro-batches.", STEP),
    Metric(
        "policy/<policy>/optimizer_state_bytes",
        "bytes",
        "Optimiser state rank 0 holds (its shard with `trainer.zero` or `trainer.distributed_optimizer`).",
        STEP,
    ),  # fmt: skip
    Metric(
        "policy/<policy>/entropy",
        "nats",
        "The policy's next-token entropy at every sampled position.",
        STEP + " with samples",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/kl", "nats", "k3 KL to the frozen initial weights.", STEP + " with `algorithm.kl_coef` > 0"
    ),
    Metric(
        "policy/<policy>/grad_norm",
        "-",
        "The global gradient norm before clipping.",
        STEP + " where some sample went through backward",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/clip_fraction",
        "share",
        "Tokens whose ratio the PPO clip cut.",
        STEP + " where some sample went through backward",
    ),  # fmt: skip
    Metric("policy/<policy>/reward_mean", "reward", "Mean reward of the step's samples.", STEP + " with samples"),
    Metric(
        "policy/<policy>/advantage_abs_mean",
        "-",
        "Mean |advantage| of the step's samples (0: nothing to learn).",
        STEP + " with samples",
    ),  # fmt: skip
    Metric("policy/<policy>/empty_steps", "count", "Steps so far that had no sample.", STEP),
    Metric("policy/<policy>/episodes", "count", "Episodes whose groups the step trained on.", STEP),
    Metric(
        "policy/<policy>/repeated_episodes",
        "count",
        "Episodes whose groups came twice (0: nothing double-counted).",
        STEP,
    ),  # fmt: skip
    Metric(
        "policy/<policy>/unaccepted_samples",
        "count",
        "`cluster.leases`: samples sent straight to the trainer "
        "by an episode attempt the router never accepted (not trained).",
        STEP + " with `cluster.leases`",
    ),  # fmt: skip
    Metric("policy/<policy>/weight_sync_bytes", "bytes", "Bytes of the weight update sent to the servers.", STEP),
    Metric("policy/<policy>/weight_sync_fraction", "share", "Of a full sync's bytes (1 without LoRA).", STEP),
    Metric(
        "policy/<policy>/checkpoint_version", "count", "The version the step checkpointed.", STEP + " that checkpointed"
    ),  # fmt: skip
    Metric("policy/<policy>/checkpoint_s", "s", "Seconds the checkpoint took.", STEP + " that checkpointed"),
    Metric(
        "policy/<policy>/stale_dropped",
        "count",
        "Samples older than `rollout.max_staleness` versions, dropped.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/staleness_mean",
        "count",
        "Versions behind the step of its samples, mean.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric("policy/<policy>/staleness_max", "count", "The same, the most.", STEP + " with bounded staleness"),
    Metric(
        "policy/<policy>/stale_samples",
        "count",
        "Samples of an older version trained on.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/stale_checked_samples",
        "count",
        "Stale samples whose log-probs were checked under their own kept weights.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/stale_unchecked_samples",
        "count",
        "Stale samples without kept weights to check.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/is_weight_mean",
        "-",
        "Mean truncated importance weight (behaviour to proximal).",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric("policy/<policy>/is_weight_max", "-", "The largest importance weight.", STEP + " with bounded staleness"),
    Metric(
        "policy/<policy>/is_truncated_fraction",
        "share",
        "Tokens whose importance weight was truncated.",
        STEP + " with bounded staleness",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/ranks",
        "count",
        "The policy's trainer ranks that reported the step.",
        STEP + " with several trainer ranks",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/rank_samples_min",
        "count",
        "The fewest samples one rank trained on.",
        STEP + " with several trainer ranks",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/rank_samples_max",
        "count",
        "The most samples one rank trained on.",
        STEP + " with several trainer ranks",
    ),  # fmt: skip
    Metric(
        "policy/<policy>/optimizer_state_bytes_max",
        "bytes",
        "The most optimiser state of any rank.",
        STEP + " with several trainer ranks",
    ),  # fmt: skip
    # -- how a step overlapped its rollout, and its precision (trainer/<policy>/...) ----------------------------
    Metric(
        "trainer/<policy>/compute_s",
        "s",
        "Seconds of the step's compute, summed over its ranks.",
        STEP + " that computed",
    ),  # fmt: skip
    Metric(
        "trainer/<policy>/overlap",
        "share",
        "Of them, the share done before each rank's last samples came.",
        STEP + " that computed",
    ),  # fmt: skip
    Metric(
        "trainer/<policy>/tail_s",
        "s",
        "From the iteration's last Groups to the weights sent.",
        STEP + " that got Groups",
    ),  # fmt: skip
    Metric(
        "trainer/<policy>/ready_early",
        "share",
        "A streamed step: the share of its kept samples whose problem was complete before the last samples came.",
        STEP + " streamed",
    ),  # fmt: skip
    Metric(
        "trainer/<policy>/ready_lead_s",
        "s",
        "A streamed step: how long before the last samples the first problem was complete.",
        STEP + " streamed",
    ),  # fmt: skip
    Metric(
        "trainer/<policy>/changed_fraction",
        "share",
        "Entries the optimiser holds that the step changed (~0: an update below the master's precision).",
        STEP + " where an optimiser step ran",
    ),  # fmt: skip
    Metric("trainer/<policy>/loss_scale", "-", "float16 compute: the loss scale.", STEP + " in float16"),
    Metric(
        "trainer/<policy>/skipped_steps",
        "count",
        "float16 compute: steps skipped for an overflow.",
        STEP + " in float16",
    ),  # fmt: skip
    # -- the router ---------------------------------------------------------------------------------------------
    Metric("router/late_groups", "count", "Groups of an abandoned episode attempt that came late (dropped).", EVERY),
    Metric("router/malformed", "count", "Messages the router could not decode so far (dropped).", EVERY),
    Metric(
        "router/refused_messages",
        "count",
        "Well-formed messages the router dropped so far (a sender that never joined, a kind its role does not send).",
        EVERY,
    ),  # fmt: skip
    Metric("router/refused_handshakes", "count", "ZeroMQ handshakes refused so far (no key of the run).", EVERY),
    Metric("router/routed_requests", "count", "Generate requests forwarded to a replica in the iteration.", EVERY),
    Metric("router/loop_lag_p50_ms", "ms", "How late the router's event loop ran a timer, median.", EVERY),
    Metric("router/loop_lag_p99_ms", "ms", "The same, 99th percentile.", EVERY),
    Metric("router/loop_lag_max_ms", "ms", "The same, the most.", EVERY),
    Metric("router/loop_work_lag_p99_ms", "ms", "Of that lag, the router's own work, 99th percentile.", EVERY),
    Metric("router/loop_work_lag_max_ms", "ms", "The same, the most.", EVERY),
    Metric("router/loop_lag_ticks", "count", "Timer ticks since the previous row.", EVERY),
    Metric("router/loop_lag_over_ms/<ms>", "count", "Of the ticks, those over <ms> late.", EVERY),
    Metric("router/loop_work_lag_over_ms/<ms>", "count", "Of the ticks, those whose own work was over <ms>.", EVERY),
    # -- faults and leases --------------------------------------------------------------------------------------
    Metric("faults/restarts/<role>", "count", "Restarts of lost <role> processes seen in the iteration.", EVERY),
    Metric("faults/reissued_episodes", "count", "Episodes of a lost env worker run again from their start.", EVERY),
    Metric("faults/reissued_requests", "count", "Generate requests of a lost replica sent again.", EVERY),
    Metric(
        "faults/recovery_s",
        "s",
        "The longest recovery completed in the iteration (a process found dead to its replacement's first result).",
        EVERY,
    ),  # fmt: skip
    Metric(
        "leases/direct_requests",
        "count",
        "Generate requests sent straight to a leased replica.",
        "runs with `cluster.leases`",
    ),  # fmt: skip
    Metric(
        "leases/direct_groups",
        "count",
        "Episodes' Groups sent straight to a trainer and accepted.",
        "runs with `cluster.leases`",
    ),  # fmt: skip
    Metric(
        "leases/stale_results",
        "count",
        "Results dropped because their request was no longer that replica's.",
        "runs with `cluster.leases`",
    ),  # fmt: skip
)

PLACEHOLDER = re.compile(r"<[a-z]+>")


@cache
def _patterns() -> list[tuple[re.Pattern[str], Metric]]:
    return [
        (re.compile("^" + PLACEHOLDER.sub("[^/]+", re.escape(m.key).replace(r"\<", "<").replace(r"\>", ">")) + "$"), m)
        for m in METRICS
    ]


def documented(key: str) -> Metric | None:
    """The entry that documents metrics key `key`, or None."""
    return next((m for pattern, m in _patterns() if pattern.match(key)), None)


def undocumented(keys: set[str] | list[str]) -> list[str]:
    """The keys of `keys` that no entry documents, sorted."""
    return sorted(k for k in set(keys) if documented(k) is None)


def metrics_markdown() -> str:
    """docs/reference/metrics.md."""
    lines = [
        "# Metrics reference",
        "",
        "Every key a run writes to `RUN_DIR/metrics.jsonl` (one JSON object a line, one line an iteration; the",
        "same keys are TensorBoard scalars and W&B metrics), generated from `mas_async/metrics_reference.py`",
        "(`python -m mas_async.reference_pages` writes this page). A key that a row does not hold was **not",
        "measured** in that iteration: it is never written as 0.0. <policy>, <agent>, <name>, <role>, <k> and",
        "<ms> stand for your policies, agents, reference policies, process roles, `eval.k` and a lag bound.",
        "",
        "| key | unit | meaning | in a row |",
        "|---|---|---|---|",
    ]
    for m in METRICS:
        lines.append(f"| `{m.key}` | {m.unit} | {m.meaning} | {m.present} |")
    return "\n".join(lines) + "\n"
