"""GPU check of the vLLM backend: NCCL weight sync into vLLM, log-prob match, broadcast cost.

One command, a few minutes on one H100/H200 (no network: the model is built in place):

    python bench/gpu_check_vllm.py               # float32 Qwen3 of Qwen3-0.6B's shape (~0.44B params)
    python bench/gpu_check_vllm.py --dtype bfloat16  # the dtype of real runs
    python bench/gpu_check_vllm.py --smoke       # builtin:small-char, seconds once vLLM is up

What it does and prints, in order:
1. Builds the model (random weights, the built-in character tokenizer) into a temporary folder; this
   process keeps it as the trainer's model, with an Adam optimiser, on GPU 0.
2. Raw baseline: a plain process on the inference GPU joins a weight group with this one, and the
   trainer broadcasts one flat buffer of exactly the model's bytes `--rounds` times (median time).
3. Starts the vLLM backend (`VLLMBackend`, the InferenceServer's), joins its worker to the weight
   group, and generates (`--prompts` prompts x n=`--n`, `--max-tokens` tokens): tokens/s.
4. One trainer step, then the weights go to vLLM as version 1 through the real protocol
   (`WeightSender` -> the worker extension -> reload -> prefix-cache reset); generates again and
   compares vLLM's log-probs of the sampled tokens with the trainer's recompute
   (`completion_logprobs`): mean and max |diff|, every output must carry version 1.
5. `--rounds` more updates: broadcast time (trainer side) and full update time (broadcast, reload,
   prefix-cache reset) against the raw broadcast of the same bytes.

NCCL cannot join two ranks on the same GPU, so the trainer and vLLM need a GPU each for an NCCL
group: with 2+ GPUs the trainer uses GPU 0 and vLLM GPU 1; with one GPU the weight group falls back
to gloo through host memory (printed; `--weight-backend nccl` forces it and fails on one GPU).
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mas_async, also where none is installed (the GPU machine)

# Tolerances of the mean |vLLM - trainer| log-prob: fp32 on GPU goes through Triton attention, whose
# fp32 dots may use TF32; bf16 rounds every activation.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    p.add_argument("--model", default="", help="a local model folder instead of the built-in Qwen3 shape")
    p.add_argument("--smoke", action="store_true", help="builtin:small-char and a small workload")
    p.add_argument("--weight-backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (one request with n)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed broadcasts / updates")
    p.add_argument("--lr", type=float, default=1e-3, help="the trainer step's Adam learning rate")
    p.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="extra vLLM engine argument, e.g. enforce_eager=false or attention_backend=FLEX_ATTENTION",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.model = args.model or "builtin:small-char"
        args.prompts, args.n, args.max_tokens, args.rounds = 8, 4, 16, 2
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg needs KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def build_model(args: argparse.Namespace, folder: Path) -> tuple[Any, Path]:
    """The trainer's model on cuda:0 and the folder vLLM loads (same weights)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from mas_async.tiny_model import EOS_ID, VOCAB, build_tokenizer, materialise

    dtype = getattr(torch, args.dtype)
    if args.model:
        path = materialise(args.model, folder) if args.model.startswith("builtin:") else Path(args.model)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda()
        return model, path
    config = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(dtype)
    path = folder / "qwen3-0.6b-shape"
    model.save_pretrained(str(path))  # writes architectures, config and safetensors
    build_tokenizer().save_pretrained(str(path))
    return model, path


def _raw_receiver(port: int, backend: str, nbytes: int, rounds: int, visible: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before this process touches CUDA
    import torch

    from mas_async.weights.group import open_weight_group

    if backend == "nccl":
        torch.cuda.set_device(0)
    group = open_weight_group(policy="raw", backend=backend, host="127.0.0.1", port=port, rank=1, world_size=2)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    for _ in range(rounds + 1):
        group.broadcast(buffer)
    if backend == "nccl":
        torch.cuda.synchronize()


def raw_broadcast_s(backend: str, nbytes: int, rounds: int, visible: str) -> float:
    """Median seconds of one broadcast of `nbytes` from here to a plain process on `visible`."""
    import torch

    from mas_async.weights.group import open_weight_group

    port = _free_port()
    child = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, backend, nbytes, rounds, visible))
    child.start()
    try:
        group = open_weight_group(policy="raw", backend=backend, host="127.0.0.1", port=port, rank=0, world_size=2)
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=group.device)
        times = []
        for i in range(rounds + 1):  # the first one also sets the communicator up: not timed
            t0 = time.perf_counter()
            group.broadcast(buffer)
            if backend == "nccl":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        child.join(timeout=120)
        group.close()
        return statistics.median(times)
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def generate(backend: Any, prompts: list[Any], args: argparse.Namespace) -> tuple[list[list[Any]], float]:
    from mas_async.inference.request import GenerationRequest

    requests = [GenerationRequest(p, n=args.n, max_tokens=args.max_tokens, temperature=1.0) for p in prompts]
    t0 = time.perf_counter()
    results = asyncio.run(backend.generate(requests))
    return results, time.perf_counter() - t0


def logprob_diff(model: Any, prompts: list[Any], results: list[list[Any]]) -> tuple[float, float]:
    import numpy as np
    import torch

    from mas_async.training.logprobs import completion_logprobs

    pairs = [(p, c) for p, group in zip(prompts, results, strict=True) for c in group]
    diffs = []
    with torch.no_grad():
        for start in range(0, len(pairs), 64):
            chunk = pairs[start : start + 64]
            ours = completion_logprobs(model, [p for p, _ in chunk], [c.token_ids for _, c in chunk], 1.0)
            diffs += [np.abs(o.float().cpu().numpy() - c.logprobs) for o, (_, c) in zip(ours, chunk, strict=True)]
    flat = np.concatenate(diffs)
    return float(flat.mean()), float(flat.max())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this check needs one (the CPU route is tests/integration/test_vllm_backend.py)")
        return 2
    gpus = torch.cuda.device_count()
    weight_backend = args.weight_backend
    if weight_backend == "auto":
        weight_backend = "nccl" if gpus >= 2 else "gloo"
    engine_gpu = "1" if gpus >= 2 else "0"
    shared = engine_gpu == "0"
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; trainer on GPU 0, vLLM on GPU {engine_gpu}; "
          f"weight sync over {weight_backend}; dtype {args.dtype}")  # fmt: skip
    if weight_backend == "gloo" and gpus < 2:
        print("  (NCCL cannot put two ranks on one GPU: with one GPU the weight group uses gloo)")
    checks: dict[str, bool] = {}

    with tempfile.TemporaryDirectory(prefix="mas-gpu-check-") as tmp:
        t0 = time.perf_counter()
        model, path = build_model(args, Path(tmp))
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        print(f"model: {path.name}, {sum(t.numel() for _, t in named) / 1e6:.1f}M parameters, "
              f"{nbytes / 2**20:.1f} MiB, built in {time.perf_counter() - t0:.1f}s")  # fmt: skip

        raw_s = raw_broadcast_s(weight_backend, nbytes, args.rounds, engine_gpu)
        print(f"raw {weight_backend} broadcast of {nbytes / 2**20:.1f} MiB: {raw_s * 1e3:.1f} ms "
              f"({nbytes / raw_s / 2**30:.1f} GiB/s)")  # fmt: skip

        from mas_async.inference.backends.vllm import VLLMBackend
        from mas_async.weights.group import open_weight_group
        from mas_async.weights.sender import WeightSender

        engine_args = {"gpu_memory_utilization": 0.5 if shared else 0.8, "enforce_eager": True}
        engine_args.update(_engine_args(args.engine_arg))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu  # read by the engine's process; ours is set up
        t0 = time.perf_counter()
        try:
            backend = VLLMBackend(path, dtype=args.dtype, max_batch_sequences=512, seed=0, engine_args=engine_args)
        finally:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        print(f"vLLM engine started in {time.perf_counter() - t0:.1f}s ({engine_args})")
        try:
            port, box = _free_port(), {}
            opener = threading.Thread(
                target=lambda: box.update(group=open_weight_group(
                    policy="check", backend=weight_backend, host="127.0.0.1", port=port, rank=0, world_size=2
                )),
                daemon=True,
            )  # fmt: skip
            opener.start()
            backend.join_weight_group(
                policy="check", backend=weight_backend, host="127.0.0.1", port=port, rank=1, world_size=2
            )
            opener.join(timeout=120)
            sender = WeightSender(box["group"])

            rng = np.random.default_rng(0)
            prompts = [
                rng.integers(7, 51, size=int(rng.integers(32, 96))).astype(np.int32) for _ in range(args.prompts)
            ]
            results, seconds = generate(backend, prompts, args)
            tokens = sum(len(c.token_ids) for group in results for c in group)
            print(f"generate v0: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.0f} tokens/s")

            def push(version: int) -> tuple[float, float]:
                """(broadcast seconds on the trainer side, full update seconds on vLLM's side)"""
                tensors = [(n, p.detach()) for n, p in model.named_parameters()]
                sent: dict[str, float] = {}

                def send() -> None:
                    start = time.perf_counter()
                    sender.send(version, tensors)
                    torch.cuda.synchronize()
                    sent["s"] = time.perf_counter() - start

                thread = threading.Thread(target=send, daemon=True)
                start = time.perf_counter()
                thread.start()
                backend.update_weights(version)
                update_s = time.perf_counter() - start
                thread.join(timeout=300)
                return sent["s"], update_s

            # One trainer step: next-token loss on the v0 samples.
            model.train()
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
            seqs = [np.concatenate([p, group[0].token_ids]) for p, group in zip(prompts, results, strict=True)][:16]
            width = min(len(s) for s in seqs)
            ids = torch.tensor(np.stack([s[:width] for s in seqs]).astype(np.int64), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            model.eval()
            before = logprob_diff(model, prompts, results)[0]  # how far the step moved the v0 samples

            push(1)
            results, seconds = generate(backend, prompts, args)
            mean, worst = logprob_diff(model, prompts, results)
            checks["every output carries version 1"] = all(c.version == 1 for g in results for c in g)
            checks[f"mean |vLLM - trainer| log-prob < {TOLERANCE[args.dtype]:g}"] = mean < TOLERANCE[args.dtype]
            checks["the step changed the log-probs (so the match means something)"] = before > 10 * mean
            print(f"after the trainer step and update to v1: mean |vLLM - trainer| log-prob {mean:.2e} "
                  f"(max {worst:.2e}); the step itself moved them by {before:.2e}")  # fmt: skip

            timings = [push(v) for v in range(2, 2 + args.rounds)]
            send_s = statistics.median(t[0] for t in timings)
            update_s = statistics.median(t[1] for t in timings)
            print(f"weight sync of {nbytes / 2**20:.1f} MiB over {weight_backend} (median of {args.rounds}): "
                  f"broadcast {send_s * 1e3:.1f} ms = {send_s / raw_s:.2f}x raw; full update (broadcast, "
                  f"reload, prefix-cache reset) {update_s * 1e3:.1f} ms = {update_s / raw_s:.2f}x raw")  # fmt: skip
            box["group"].close()
        finally:
            backend.close()

    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
