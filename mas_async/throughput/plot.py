"""PNG plots of a `mas-async bench` run (RUN_DIR/bench.json), drawn by `mas-async plot RUN_DIR`.

`throughput.png`: generated tokens/s per policy and in total for each measured setting (and the engine
alone, with `--baseline`); `time.png`: where an episode's time goes, and each replica's busy fraction;
`scaling.png` (a sweep of one numeric key): tokens/s and the ideal linear scaling against the value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_bench(bench_file: Path, out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    summary: dict[str, Any] = json.loads(bench_file.read_text())
    results = summary["results"]
    labels = [", ".join(f"{k}={v}" for k, v in r["setting"].items()) or "as configured" for r in results]
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    policies = list(results[0]["policies"])
    width = 0.8 / (len(policies) + 2)
    for j, name in enumerate([*policies, "total"]):
        values = [(r["total"] if name == "total" else r["policies"][name])["tokens_per_s"] for r in results]
        ax.bar([i + j * width for i in range(len(results))], values, width, label=name)
    if "baseline" in results[0]:
        alone = [sum(b["tokens_per_s"] for b in r["baseline"].values()) for r in results]
        ax.bar([i + (len(policies) + 1) * width for i in range(len(results))], alone, width, label="engines alone")
    ax.set_xticks([i + width * len(policies) / 2 for i in range(len(results))], labels, fontsize="small")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("rollout throughput")
    ax.legend(fontsize="small")
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    # The router's share is part of the wait for generation: stacked as its own slice of it.
    parts = {
        "generation (engine, queues)": [
            max(0.0, r["episode_time"]["waiting_for_generation_s"] - r["episode_time"]["in_router_s"]) for r in results
        ],
        "router (at most)": [r["episode_time"]["in_router_s"] for r in results],
        "env": [r["episode_time"]["in_env_s"] for r in results],
    }
    bottom = [0.0] * len(results)
    for label, values in parts.items():
        left.bar(range(len(results)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_xticks(range(len(results)), labels, fontsize="small")
    left.set_ylabel("seconds per episode")
    left.set_title("where an episode's time goes")
    left.legend(fontsize="small")
    replicas = sorted({name for r in results for name in r["replicas"]})
    step = 0.8 / max(1, len(replicas))
    for j, name in enumerate(replicas):
        values = [r["replicas"].get(name, {}).get("busy_fraction", 0.0) for r in results]
        right.bar([i + j * step for i in range(len(results))], values, step, label=name)
    right.set_xticks([i + step * (len(replicas) - 1) / 2 for i in range(len(results))], labels, fontsize="small")
    right.set_ylim(0, 1)
    right.set_title("inference replicas: busy fraction")
    right.legend(fontsize="small")
    paths.append(out / "time.png")
    fig.savefig(paths[-1], dpi=100)

    scaling = summary.get("scaling") or []
    if scaling and all("efficiency" in row for row in scaling):
        key = summary["sweep"][0][0]
        xs = [row["setting"][key] for row in scaling]
        ys = [row["tokens_per_s"] for row in scaling]
        first = min(range(len(xs)), key=lambda i: xs[i])
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.add_subplot()
        ax.plot(xs, ys, "o-", label="measured")
        ax.plot(xs, [ys[first] * x / xs[first] for x in xs], "--", color="gray", label="linear")
        ax.set_xlabel(key)
        ax.set_ylabel("generated tokens/s")
        ax.set_title("scaling")
        ax.legend(fontsize="small")
        paths.append(out / "scaling.png")
        fig.savefig(paths[-1], dpi=100)
    return paths
