"""Peak memory of one training step against the completion length: what a step's log-probs, activations
and gradients add, per completion length T, on random weights in the Qwen3 architecture.

    python bench/train_memory.py --vocab 151936 --hidden 256 --layers 2 --tokens 512 4096 --samples 1
    python bench/train_memory.py --repeats 3 --json figures.json    # median and range of 3 runs per T
    python bench/train_memory.py --set trainer.activation_checkpointing=true
    python bench/train_memory.py --smoke                             # a tiny shape, seconds

Each run is one `PolicyLearner.step` (the trainer's own step: micro-batches, log-probs, loss, backward,
optimiser) on `--samples` samples of one prompt of `--prompt-tokens` tokens, each with T completion
tokens, in a fresh process of its own, so that nothing one run allocated is left for another to reuse.
The samples carry an entropy bonus (`algorithm.entropy_coef`), so that every one of them goes through
backward (a lone sample's group-relative advantage is 0, and the learner skips such a sample), and the
entropy's own backward is part of what is measured.

Peak memory is what the step adds over what the process held just before it:
- CPU: the peak resident set (VmHWM, reset just before the step through /proc/self/clear_refs, after the
  freed heap went back to the system) minus the resident set (VmRSS) before the step; where the peak cannot
  be reset, `getrusage`'s ru_maxrss stands in for it (then an earlier, higher peak could hide the step's).
- GPU: `torch.cuda.max_memory_allocated` minus `torch.cuda.memory_allocated` before the step.

The model: Qwen3's proportions (heads of 64 dimensions, 128 from a hidden size of 1,024, half as many
key/value heads, an MLP 3x the hidden size, tied embeddings), float32 weights drawn at random, written
once to a temporary folder that every run loads. The figures (`--json`): a list of
`{"tokens": T, "peak_bytes": B, "base_bytes": ..., "runs": [...]}`, B the median over `--repeats` runs, and
the difference peak(last T) - peak(first T) is printed: the part of a step's memory that grows with T.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/plan_path_tiny.yaml"
POLICY = "vertical"
ENTROPY_COEF = 1e-3
"""The entropy bonus that sends every sample, a lone one too, through backward."""
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's: 151,936)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="completion lengths T to measure")
    p.add_argument("--samples", type=int, default=1, help="samples per step (one prompt's completions)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens of the samples' prompt")
    p.add_argument("--repeats", type=int, default=1, help="runs per T (each in a fresh process)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a config override, key=value")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--smoke", action="store_true", help="a tiny shape: seconds")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run, its spec as JSON
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab, args.hidden, args.layers, args.tokens, args.samples = 1024, 64, 1, [16, 256], 2
        args.prompt_tokens, args.repeats = 8, 1
    return args


def write_model(folder: Path, vocab: int, hidden: int, layers: int, positions: int) -> None:
    """A Qwen3-architecture model with random float32 weights (seeded) in `folder`, as a hub's folder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    head_dim = 128 if hidden >= 1024 else min(64, hidden)
    heads = max(1, hidden // head_dim)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=head_dim, intermediate_size=3 * hidden,
        max_position_embeddings=positions, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(folder))


def _status_bytes(field: str) -> int:
    """A `/proc/self/status` memory figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset the process's peak resident set to its current one (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _trim_heap() -> None:
    """Hand the heap's free memory back to the system, so that the step cannot reuse it unseen."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One step in this process: build the learner, then measure the step's peak over what it held before."""
    import gc
    import resource

    import numpy as np
    import torch

    from mas_async.config import load_config
    from mas_async.training.learner import PolicyLearner
    from mas_async.wire.samples import Sample

    device = spec["device"]
    overrides = [
        f"policies.{POLICY}.model={spec['model']}", f"policies.{POLICY}.device={device}",
        f"algorithm.entropy_coef={ENTROPY_COEF}", "run.iterations=1", *spec["overrides"],
    ]  # fmt: skip
    config = load_config(CONFIG, overrides)
    learner = PolicyLearner(config, POLICY, spec["model"])
    rng = np.random.default_rng(0)
    vocab, tokens = spec["vocab"], spec["tokens"]
    prompt = rng.integers(0, vocab, size=spec["prompt_tokens"]).astype(np.int32)
    completions = [rng.integers(0, vocab, size=tokens).astype(np.int32) for _ in range(spec["samples"])]
    samples = [
        Sample("e0/vertical/0", "e0", "p", POLICY, POLICY, 0, prompt, c, np.zeros(tokens, np.float32), 0, float(i % 2))
        for i, c in enumerate(completions)
    ]
    gc.collect()
    began = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        metrics = learner.step(samples, 0)
        torch.cuda.synchronize()
        peak, how = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    else:
        _trim_heap()
        base = _status_bytes("VmRSS")
        if _reset_peak():
            metrics = learner.step(samples, 0)
            peak, how = _status_bytes("VmHWM"), "VmHWM"
        else:
            metrics = learner.step(samples, 0)
            peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
    seconds = time.perf_counter() - began
    return {
        "tokens": tokens, "peak_bytes": peak - base, "base_bytes": base, "seconds": seconds, "measure": how,
        "micro_batches": metrics["micro_batches"],
    }  # fmt: skip


def measure(args: argparse.Namespace, model: Path, device: str, tokens: int) -> dict[str, Any]:
    """One run for completion length `tokens`, in a fresh process."""
    spec = {
        "model": str(model), "device": device, "vocab": args.vocab, "tokens": tokens, "samples": args.samples,
        "prompt_tokens": args.prompt_tokens, "overrides": args.overrides,
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the run at T={tokens} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"one training step, Qwen3 architecture: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.samples} sample(s) of {args.prompt_tokens} prompt + T completion tokens, on {device}"
        + (f", {' '.join(args.overrides)}" if args.overrides else "")
    )
    figures: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="train_memory-") as tmp:
        model = Path(tmp) / "model"
        write_model(model, args.vocab, args.hidden, args.layers, args.prompt_tokens + max(args.tokens) + 1)
        runs: dict[int, list[dict[str, Any]]] = {t: [] for t in args.tokens}
        for _ in range(args.repeats):  # the lengths take turns, so that a drift of the machine hits them alike
            for tokens in args.tokens:
                run = measure(args, model, device, tokens)
                runs[tokens].append(run)
                print(f"    run: T={tokens} peak {run['peak_bytes'] / GB:.3f} GB in {run['seconds']:.1f} s", flush=True)
    for tokens in args.tokens:
        peaks = [r["peak_bytes"] for r in runs[tokens]]
        figures.append({
            "tokens": tokens, "peak_bytes": int(statistics.median(peaks)),
            "base_bytes": int(statistics.median(r["base_bytes"] for r in runs[tokens])), "runs": runs[tokens],
        })  # fmt: skip
        seconds = statistics.median(r["seconds"] for r in runs[tokens])
        print(
            f"  T={tokens:>6}: peak {statistics.median(peaks) / GB:7.3f} GB ({min(peaks) / GB:.3f}-"
            f"{max(peaks) / GB:.3f}, {len(peaks)} runs) over {figures[-1]['base_bytes'] / GB:.3f} GB held before; "
            f"{runs[tokens][0]['micro_batches']} micro-batch(es), {seconds:.1f} s ({runs[tokens][0]['measure']})"
        )
    if len(figures) > 1:
        first, last = figures[0], figures[-1]
        grows = [
            b["peak_bytes"] - a["peak_bytes"] for a, b in zip(runs[first["tokens"]], runs[last["tokens"]], strict=True)
        ]
        grown = (last["peak_bytes"] - first["peak_bytes"]) / GB
        print(
            f"peak({last['tokens']}) - peak({first['tokens']}): {grown:.3f} GB"
            f" (per repeat {min(grows) / GB:.3f}-{max(grows) / GB:.3f})"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
