"""The trainer's log-prob passes on tree groups: seconds per forward + backward of an iteration's samples,
three ways on the same samples, against the raw baseline measured in the same run.

- baseline: transformers' usual call, the right-padded batch of whole sequences with its attention mask;
- unmasked: the same batch without the mask (`share_prompts=False`): exact for right padding under
  causal attention, and the attention takes its fused causal kernel;
- shared: what the trainer does (`completion_logprobs`): each distinct prompt once, its K candidates'
  completions attending to its key/value cache.

Then whole training steps of the learner (`PolicyLearner.step`, one optimiser step, the default) on the
same samples, two ways: the old log-probs recomputed in a no-grad pass over every sample (the baseline,
`force_recompute`), and taken from the training pass itself (what the trainer does).

The samples are shaped like `bench/staleness.py`'s code-env iterations (recorded there: prompts of
~750-2,000 tokens, completions of ~70-900, K = 4 candidates per prompt), in micro-batches of 8 as the
trainer's `micro_batch_sequences` cuts them. Every way's log-probs are checked against the baseline's.

    python bench/trainer_logprobs.py              # builtin:tiny-ascii, 64 samples, 5 repeats
    python bench/trainer_logprobs.py --smoke      # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mas_async.machine_paths import without_machine_paths
from mas_async.training.logprobs import completion_logprobs

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("baseline", "unmasked", "shared")


def masked_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    """The baseline: one right-padded batch with an attention mask, log-probs of the completion tokens."""
    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, sequences))
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.from_numpy(s), 1
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=torch.arange(width).expand_as(ids), use_cache=False
    ).logits
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        logp = torch.log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(c)].float(), dim=-1)
        out.append(logp.gather(-1, ids[i, len(p) : len(p) + len(c), None]).squeeze(-1))
    return out


def samples(count: int, group: int, prompt_range: tuple[int, int], completion_range: tuple[int, int], seed: int):
    """`count` (prompt, completion) pairs, `group` completions per prompt, in group order."""
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for _ in range(0, count, group):
        prompt = rng.integers(7, 90, size=int(rng.integers(*prompt_range))).astype(np.int32)
        for _ in range(group):
            prompts.append(prompt)
            completions.append(rng.integers(7, 90, size=int(rng.integers(*completion_range))).astype(np.int32))
    return prompts[:count], completions[:count]


def step(way: str, model, prompts, completions, micro: int) -> tuple[float, list[torch.Tensor]]:
    """Seconds of a no-grad pass (the old log-probs) and a forward + backward of every micro-batch."""
    model.zero_grad(set_to_none=True)
    compute = {
        "baseline": lambda p, c: masked_logprobs(model, p, c),
        "unmasked": lambda p, c: completion_logprobs(model, p, c, share_prompts=False),
        "shared": lambda p, c: completion_logprobs(model, p, c),
    }[way]
    start, kept = time.perf_counter(), []
    for i in range(0, len(prompts), micro):
        chunk = (prompts[i : i + micro], completions[i : i + micro])
        with torch.no_grad():
            kept += compute(*chunk)
        sum(lp.sum() for lp in compute(*chunk)).backward()
    return time.perf_counter() - start, kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny-ascii")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--group", type=int, default=4, help="K: completions per prompt")
    p.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, the ways interleaved")
    p.add_argument("--json", type=Path)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    prompt_range, completion_range = (750, 2000), (70, 900)
    if args.smoke:
        args.samples, args.repeats, prompt_range, completion_range = 16, 1, (60, 200), (10, 60)

    from transformers import AutoModelForCausalLM

    from mas_async.launch.launcher import model_cache_dir
    from mas_async.tiny_model import materialise

    torch.manual_seed(0)
    path = materialise(args.model, model_cache_dir()) if args.model.startswith("builtin:") else args.model
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    prompts, completions = samples(args.samples, args.group, prompt_range, completion_range, seed=0)
    step("shared", model, prompts[: args.micro], completions[: args.micro], args.micro)  # warm-up
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    diffs: dict[str, float] = {}
    for _ in range(args.repeats):
        outputs = {}
        for way in WAYS:
            s, outputs[way] = step(way, model, prompts, completions, args.micro)
            seconds[way].append(s)
        for way in WAYS[1:]:
            diff = torch.cat(outputs[way]).sub(torch.cat(outputs["baseline"])).abs().max()
            diffs[way] = max(diffs.get(way, 0.0), float(diff))
    tokens = sum(len(a) + len(b) for a, b in zip(prompts, completions, strict=True))
    print(
        f"trainer log-prob passes: {args.model}, {args.samples} samples ({tokens} tokens), K={args.group}, "
        f"micro-batches of {args.micro}, {args.repeats} repeats (median, range)"
    )
    result: dict[str, Any] = {"bench": "trainer_logprobs", "args": vars(args), "ways": {}}
    for way in WAYS:
        ratios = [b / s for b, s in zip(seconds["baseline"], seconds[way], strict=True)]  # paired by round
        result["ways"][way] = {"seconds": seconds[way], "speedup": ratios, "max_abs_diff": diffs.get(way, 0.0)}
        print(
            f"  {way:<9} {statistics.median(seconds[way]):7.3f} s ({min(seconds[way]):.3f}-{max(seconds[way]):.3f})"
            f"  speedup vs baseline {statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            f"  max |logprob - baseline| {diffs.get(way, 0.0):.1e}"
        )
    result["learner_steps"] = learner_steps(str(path), prompts, completions, args)
    if args.json:
        args.json.write_text(json.dumps(without_machine_paths(result), indent=1))
    return 0


def learner_steps(path: str, prompts, completions, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds of `PolicyLearner.step` with the old log-probs recomputed for every sample and taken from
    the training pass, paired by round; and how far apart the two learners' weights end up."""
    from mas_async.config import load_config
    from mas_async.training.learner import PolicyLearner
    from mas_async.wire.samples import Sample

    config = load_config(ROOT / "configs/code_tiny_shared.yaml", [f"trainer.micro_batch_sequences={args.micro}"])
    rng = np.random.default_rng(1)
    batch = [
        Sample(f"e{i // args.group}/shared/0", f"e{i // args.group}", "p", "shared", "shared", 0, p, c,
               np.full(len(c), -4.5, np.float32), 0, float(rng.normal()))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]  # fmt: skip
    learners = {}
    for way in ("recompute", "reuse"):
        torch.manual_seed(0)
        learners[way] = PolicyLearner(config, "shared", path)
    learners["recompute"].force_recompute = True
    seconds: dict[str, list[float]] = {way: [] for way in learners}
    for version in range(args.repeats):
        for way, learner in learners.items():
            start = time.perf_counter()
            learner.step(batch, version)
            seconds[way].append(time.perf_counter() - start)
    ratios = [r / s for r, s in zip(seconds["recompute"], seconds["reuse"], strict=True)]
    weights = [torch.cat([t.flatten() for _, t in learner.named_tensors()]) for learner in learners.values()]
    drift = float((weights[0] - weights[1]).abs().max() / weights[0].abs().max())
    print(
        f"learner steps ({args.repeats}, one optimiser step each): old log-probs recomputed vs from the training pass"
    )
    for way in learners:
        print(f"  {way:<9} {statistics.median(seconds[way]):7.3f} s ({min(seconds[way]):.3f}-{max(seconds[way]):.3f})")
    print(
        f"  from the training pass: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) of the "
        f"recompute's speed; weights apart by {drift:.1e} of their largest after {args.repeats} steps"
    )
    return {"seconds": seconds, "speedup": ratios, "weight_drift": drift}


if __name__ == "__main__":
    sys.exit(main())
