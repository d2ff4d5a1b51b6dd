"""Two role-specialised policies on one base: the LoRA demo with each policy on its own inference server
against both on one server (`policies.vertical.base=horizontal`: one copy of the model, each policy's
own adapters), and the role-swap probe on the shared run.

Each (arm, seed) is one `mas-async train` of the Plan-Path demo with the LoRA settings of
`configs/plan_path_tiny_lora.yaml` (bench/staleness_learning.py's `train`), one after another. Printed
per arm (over seeds): held-out success of the first and last tenth of the evaluations, final success
(mean of the last 3), wall time, the inference processes the run had and their peak resident memory
together (sampled every 0.2 s), and the max over iterations of each policy's `version_mismatch` (must
stay 0) and `logprob_abs_diff`. Then the role-swap probe: the shared run's last checkpoints evaluated
as trained and with the two policies' roles swapped (`mas-async eval` of the shared config, the same
held-out problems): specialised adapters solve less in each other's role.

    python bench/shared_base.py                       # seed 0, 200 iterations per arm
    python bench/shared_base.py --arms shared --seeds 0 1
    python bench/shared_base.py --smoke               # 2 iterations per arm: the plumbing only

Writes OUT/shared_base.json and OUT/shared_base.png (success vs wall time, vs iterations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import yaml

from bench.ablation import checkpoint, evaluate
from bench.ranks_learning import tenth, worst
from bench.staleness_learning import ROOT, SMOKE, curve, final, fmt, plot, train

LORA_CONFIG = "configs/plan_path_tiny_lora.yaml"
LORA = [
    "policies.vertical.lora={r: 16, alpha: 32}",
    "policies.horizontal.lora={r: 16, alpha: 32}",
    "policies.vertical.lr=3e-3",
    "policies.horizontal.lr=3e-3",
]
"""configs/plan_path_tiny_lora.yaml's settings, over bench/staleness_learning.py's CONFIG."""
ARMS = {
    "separate servers": LORA,
    "shared base": [*LORA, "policies.vertical.base=horizontal"],
}
ARM_IDS = dict(zip(["separate", "shared"], ARMS, strict=True))


def inference_processes(run_dir: Path) -> list[str]:
    return sorted(name for name in json.loads((run_dir / "pids.json").read_text()) if name.startswith("inference/"))


class InferenceMemory:
    """The peak, over the run, of the resident memory of its inference processes together (their pids from
    RUN_DIR/pids.json; VmRSS from /proc), sampled in a thread every `period_s`."""

    def __init__(self, run_dir: Path, period_s: float = 0.2) -> None:
        self.run_dir, self.period_s = run_dir, period_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> InferenceMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                pids = json.loads((self.run_dir / "pids.json").read_text())
            except (OSError, ValueError):
                continue
            total = sum(_rss(pid) for name, pid in pids.items() if name.startswith("inference/"))
            self.peak_bytes = max(self.peak_bytes, total)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def role_swap(run_dir: Path, iterations: int, eval_size: int, out: Path) -> dict[str, float]:
    """Held-out success of the run's last checkpoints as trained and with the policies' roles swapped,
    evaluated with the shared run's config (evaluation serves each policy alone, from its merged model)."""
    raw = yaml.safe_load((ROOT / LORA_CONFIG).read_text())
    raw["policies"]["vertical"]["base"] = "horizontal"
    config = out / "shared_base.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    trained = {p: checkpoint(run_dir, p, iterations) for p in ("vertical", "horizontal")}
    swapped = {"vertical": trained["horizontal"], "horizontal": trained["vertical"]}
    return {
        "as trained": evaluate(str(config), trained, run_dir.parent / f"{run_dir.name}-eval", eval_size),
        "roles swapped": evaluate(str(config), swapped, run_dir.parent / f"{run_dir.name}-swapped", eval_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--arms", nargs="+", choices=list(ARM_IDS), default=list(ARM_IDS))
    parser.add_argument("--eval-size", type=int, default=64, help="held-out problems of the role-swap probe")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "shared_base")
    parser.add_argument("--smoke", action="store_true", help="2 iterations per arm, small batches")
    args = parser.parse_args()
    if args.smoke:
        args.iterations, args.eval_size = 2, 4
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict] = {}
    for arm_id in args.arms:
        arm = ARM_IDS[arm_id]
        runs = []
        for seed in args.seeds:
            run_dir = args.out / f"{arm_id}-seed{seed}"
            started = time.monotonic()
            with InferenceMemory(run_dir) as memory:
                overrides = [*ARMS[arm], *(SMOKE if args.smoke else [])]
                train(run_dir, seed, args.iterations, overrides, f"{arm}, seed {seed}")
            c = curve(run_dir)
            run = {"seed": seed, "first": tenth(c, False), "last": tenth(c, True), "final": final(c)}
            run |= {"wall_s": time.monotonic() - started, "inference": inference_processes(run_dir)}
            run |= {"inference_peak_rss_mib": memory.peak_bytes / 2**20, "worst": worst(run_dir)}
            if arm_id == "shared":
                run["probe"] = role_swap(run_dir, args.iterations, args.eval_size, args.out)
            runs.append(run)
            print(f"{arm}, seed {seed}: {json.dumps(run)}", flush=True)
        results[arm] = {"runs": runs}

    print(
        "\n| arm | first tenth | last tenth | final | wall s | inference processes | their peak RSS MiB "
        "| max logprob diff | mismatch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, result in results.items():
        runs = result["runs"]
        diff = max(v for r in runs for k, v in r["worst"].items() if k.endswith("/logprob_abs_diff"))
        mismatch = max(v for r in runs for k, v in r["worst"].items() if k.endswith("/version_mismatch"))
        processes = ", ".join(runs[0]["inference"])
        print(
            f"| {arm} | {fmt([r['first'] for r in runs])} | {fmt([r['last'] for r in runs])} | "
            f"{fmt([r['final'] for r in runs])} | {fmt([r['wall_s'] for r in runs])} | {processes} | "
            f"{fmt([r['inference_peak_rss_mib'] for r in runs])} | {diff:.1e} | {mismatch} |"
        )
    shared = results.get("shared base")
    if shared is not None:
        probes = [r["probe"] for r in shared["runs"]]
        print("\nrole-swap probe (shared base, last checkpoints, held-out success):")
        for key in ("as trained", "roles swapped"):
            print(f"  {key:<14} {statistics.fmean(p[key] for p in probes):.3f}  (seeds: {[p[key] for p in probes]})")
    (args.out / "shared_base.json").write_text(json.dumps(results, indent=2))
    plot_runs(args.out, args.arms, args.seeds)


def plot_runs(out: Path, arm_ids: list[str], seeds: list[int]) -> None:
    """OUT/shared_base.png: every run's held-out success against wall time and against iterations."""
    curves = {ARM_IDS[a]: [curve(out / f"{a}-seed{seed}") for seed in seeds] for a in arm_ids}
    title = "Plan-Path, LoRA r=16: each policy on its own server vs both on one base"
    plot(curves, out / "shared_base.png", "inference servers", title)


if __name__ == "__main__":
    main()
