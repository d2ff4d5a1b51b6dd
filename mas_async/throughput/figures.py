"""The figures of a rollout-only run, per policy and in total, and the same prompts on each engine alone.

Only the measured phases count (not the warm-up). Definitions:
- tokens/s: generated tokens (every candidate's completion) over the phases' wall time; prompt tokens/s
  counts each request's prompt once (its n samples share one prefill);
- env steps/s: one per candidate (each steps its own env clone);
- generate latency: request to reply, as the env worker saw it (router, queue and engine included);
- episode time: from RunEpisode to EpisodeDone in the env worker; "waiting for generation" is the time
  at least one of its requests was pending (agents acting at once wait together); "in the env" is the rest
  (env steps, sandbox runs, scoring, tokenising); "in the router" is the router's CPU per message times
  the messages per episode, an upper bound on what routing adds;
- a replica's busy fraction: the union of its batches' windows over the phases' wall time (a
  continuous-batching engine runs several at once), and its mean batch size in sequences.

`baseline()` replays each policy's recorded prompts on that policy's engine alone, in this process,
phase by phase in lockstep waves (the j-th request of every episode as one batch: the most any framework
could batch, since an episode's next prompt depends on its last answer); only generate calls are timed.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mas_async.config import Config


def iteration_of(episode_id: str) -> int:
    """'train3-12' -> 3."""
    return int(episode_id.removeprefix("train").split("-")[0])


def union(batches: list[list[float]]) -> list[tuple[float, float]]:
    """Disjoint (start, end) intervals covering the (start, end, sequences) batches."""
    merged: list[tuple[float, float]] = []
    for start, end, _ in sorted(batches):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.array(values) * 1000
    return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)}


def _policy_figures(requests: list[list[Any]], phases: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    tokens = float(sum(r[7] for r in requests))
    per_phase = []
    for phase in phases:
        inside = [r for r in requests if iteration_of(r[0]) == phase["iteration"]]
        per_phase.append(sum(r[7] for r in inside) / max(1e-9, phase["end"] - phase["start"]))
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "phase_tokens_per_s": per_phase,
        "prompt_tokens_per_s": sum(len(r[2]) for r in requests) / wall,
        "requests": len(requests),
        "env_steps_per_s": sum(r[3] for r in requests) / wall,
        "latency_ms": _percentiles([r[6] - r[5] for r in requests]),
    }


def figures(record: dict[str, Any], policies: list[str]) -> dict[str, Any]:
    """Per policy and total figures of the measured phases of a rollout-only run."""
    phases = [p for p in record["phases"] if not p["warmup"]]
    if not phases:
        raise ValueError("no measured phase: run at least one phase after the warm-up")
    measured = {p["iteration"] for p in phases}
    wall = sum(p["end"] - p["start"] for p in phases)
    requests = [r for r in record["requests"] if iteration_of(r[0]) in measured]
    total = _policy_figures(requests, phases, wall)
    total["episodes_per_s"] = sum(p["episodes"] for p in phases) / wall
    total["dropped"] = float(sum(p["dropped"] for p in phases))
    total["seconds"] = wall
    per_policy = {p: _policy_figures([r for r in requests if r[1] == p], phases, wall) for p in policies}
    messages = sum(p["router_messages"] for p in phases)
    router_cpu = sum(p["router_cpu_s"] for p in phases)
    router = {
        "messages_per_s": messages / wall,
        "cpu_us_per_message": 1e6 * router_cpu / max(1, messages),
        "cpu_fraction": router_cpu / wall,
    }
    episodes = [e for e in record["episodes"] if e[0].startswith("train") and iteration_of(e[0]) in measured]
    count = max(1, len(episodes))
    episode_s = sum(e[1] for e in episodes) / count
    waiting_s = sum(e[2] for e in episodes) / count
    per_episode_messages = messages / count
    time_split = {
        "episode_s": episode_s,
        "waiting_for_generation_s": waiting_s,
        "in_env_s": max(0.0, episode_s - waiting_s),
        "in_router_s": router["cpu_us_per_message"] * 1e-6 * per_episode_messages,
    }
    replicas = {}
    for name, batches in record["batches"].items():
        inside = [b for b in batches if any(overlap(b[0], b[1], p["start"], p["end"]) > 0 for p in phases)]
        busy = sum(overlap(s, e, p["start"], p["end"]) for s, e in union(inside) for p in phases)
        replicas[name] = {
            "busy_fraction": busy / wall,
            "mean_batch_sequences": float(np.mean([b[2] for b in inside])) if inside else 0.0,
            "batches": len(inside),
        }
    return {
        "total": total,
        "policies": per_policy,
        "router": router,
        "episode_time": time_split,
        "replicas": replicas,
        "processes": record["processes"],
    }


def lockstep_waves(requests: list[list[Any]], iteration: int) -> list[list[list[Any]]]:
    """The requests of one phase as batches: the j-th request of every episode form batch j."""
    by_episode: dict[str, list[list[Any]]] = defaultdict(list)
    for request in requests:
        if iteration_of(request[0]) == iteration:
            by_episode[request[0]].append(request)
    ordered = [sorted(rs, key=lambda r: r[5]) for rs in by_episode.values()]
    depth = max((len(rs) for rs in ordered), default=0)
    return [[rs[j] for rs in ordered if j < len(rs)] for j in range(depth)]


def baseline(config: Config, record: dict[str, Any], model_paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each policy's recorded prompts replayed on its engine alone: policy -> seconds, tokens, tokens/s
    (total and per measured phase)."""
    return {policy: _replay(config, policy, record, model_paths[policy]) for policy in config.policies}


def _replay(config: Config, policy: str, record: dict[str, Any], model_path: str) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    from mas_async.inference.backends.base import make_backend
    from mas_async.inference.request import GenerationRequest
    from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

    hf_logging.disable_progress_bar()  # one line per weight file otherwise, between the report's lines
    torch.set_num_threads(config.cluster.torch_threads)
    spec, rollout = config.policies[policy], config.rollout
    backend = make_backend(
        spec.backend, model_path, dtype=spec.dtype, max_batch_sequences=spec.max_batch_sequences,
        seed=config.run.seed * 1000,
    )  # fmt: skip
    stops = stop_token_ids(load_tokenizer(model_path))
    requests = [r for r in record["requests"] if r[1] == policy]

    def request(r: list[Any]) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=np.asarray(r[2]), n=r[3], max_tokens=rollout.max_tokens, temperature=rollout.temperature,
            top_p=rollout.top_p, greedy=r[4], stop_token_ids=stops,
        )  # fmt: skip

    async def replay() -> dict[str, Any]:
        per_phase: list[tuple[float, float]] = []  # (seconds, tokens) of each measured phase
        for phase in record["phases"]:
            seconds = tokens = 0.0
            for wave in lockstep_waves(requests, phase["iteration"]):
                start = time.perf_counter()
                results = await backend.generate([request(r) for r in wave])
                seconds += time.perf_counter() - start
                tokens += sum(len(c.token_ids) for group in results for c in group)
            if not phase["warmup"]:
                per_phase.append((seconds, tokens))
        seconds, tokens = sum(s for s, _ in per_phase), sum(t for _, t in per_phase)
        return {
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "phase_tokens_per_s": [t / s for s, t in per_phase if s],
        }

    return asyncio.run(replay())


def overhead_ratio(framework: dict[str, Any], standalone: dict[str, Any]) -> float:
    """Median phase tokens/s of the framework over the engine alone's (one slow phase on a shared
    machine does not decide it)."""
    ours, raw = framework["phase_tokens_per_s"], standalone["phase_tokens_per_s"]
    if not ours or not raw:
        return 0.0
    return float(np.median(ours)) / float(np.median(raw))
