"""`mas-async bench CONFIG`: the rollout throughput of a config's deployment, and where its time goes.

It starts the config's deployment for rollout only (router, env workers, inference servers with their
replicas; no trainers; the config's models, or a checkpoint's weights with `checkpoint=RUN_DIR`), runs
`--warmup` + `--phases` rollout phases of the config's training episodes, prints the figures
(`mas_async.throughput.figures`) and writes them to RUN_DIR/bench.json (`mas-async plot RUN_DIR` draws
them). A workflow program's calls are measured like a node's, each credited to its episode, whoever makes
them: the program, or an agent service outside the run calling the gateways of `gateway.external`
(docs/gateway.md; start the service first). `--baseline` replays the recorded prompts on each policy's
engine alone and prints the overhead ratio per policy. `--sweep KEY=V1,V2` (one or two keys) measures each
setting and prints throughput against it with the scaling efficiency: throughput / (value / smallest value
x throughput at the smallest value).
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from mas_async.config import Config, ConfigError, load_config
from mas_async.throughput.figures import baseline, figures, overhead_ratio
from mas_async.throughput.run import load_record, run_rollout

BENCH_FILE = "bench.json"


def parse_sweep(specs: list[str]) -> list[tuple[str, list[Any]]]:
    """["cluster.env_workers=1,2,4"] -> [("cluster.env_workers", [1, 2, 4])]; at most two keys."""
    if len(specs) > 2:
        raise ConfigError(f"--sweep takes one or two keys, got {len(specs)}")
    parsed = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--sweep {spec!r} is not of the form section.key=V1,V2,...")
        parsed.append((key.strip(), [yaml.safe_load(v) for v in values.split(",") if v.strip()]))
    return parsed


def settings(sweep: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """Every combination of the swept values ([{}] without a sweep)."""
    keys = [key for key, _ in sweep]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(values for _, values in sweep))]


def bench_config(path: str, overrides: list[str], setting: dict[str, Any], phases: int, run_dir: Path) -> Config:
    """The config of one measurement; an unknown or mistyped key (swept ones included) is a ConfigError
    naming it."""
    swept = [f"{key}={json.dumps(value)}" for key, value in setting.items()]
    forced = [f"run.iterations={phases}", "eval.every=0", f"run.output_dir={run_dir}"]
    return load_config(path, [*overrides, *swept, *forced])


def measure(config: Config, *, warmup: int, with_baseline: bool, timeout_s: float) -> dict[str, Any]:
    run_dir, deployment = run_rollout(config, warmup=warmup, timeout_s=timeout_s)
    record = load_record(run_dir)
    result = figures(record, list(config.policies))
    result["run_dir"] = str(run_dir)
    if with_baseline:
        standalone = baseline(config, record, deployment.model_paths | deployment.weights_paths)
        result["baseline"] = {
            policy: {**alone, "overhead_ratio": overhead_ratio(result["policies"][policy], alone)}
            for policy, alone in standalone.items()
        }
    return result


def run_bench(
    config_path: str,
    overrides: list[str],
    *,
    phases: int,
    warmup: int,
    with_baseline: bool,
    sweep_specs: list[str],
    timeout_s: float = 600.0,
) -> Path:
    """Measure every setting; returns the directory holding bench.json."""
    sweep = parse_sweep(sweep_specs)
    if phases < 1 or warmup < 0:
        raise ConfigError(f"--phases must be at least 1 and --warmup at least 0 (got {phases}, {warmup})")
    base = load_config(config_path, overrides)  # errors in the overrides are reported before any sweep key
    out = Path(base.run.output_dir or f"runs/{base.run.name}-bench/{datetime.now():%Y%m%d-%H%M%S}")
    combos = settings(sweep)
    configs = []
    for index, setting in enumerate(combos):  # every setting validated before anything starts
        run_dir = out / f"setting-{index}" if sweep else out
        configs.append(bench_config(config_path, overrides, setting, phases, run_dir))
    results = []
    for setting, config in zip(combos, configs, strict=True):
        result = measure(config, warmup=warmup, with_baseline=with_baseline, timeout_s=timeout_s)
        results.append({"setting": setting, **result})
        print(table(config, setting, result))
    summary = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "config": config_path,
        "overrides": overrides,
        "phases": phases,
        "warmup": warmup,
        "sweep": [[key, values] for key, values in sweep],
        "results": results,
    }
    if sweep:
        summary["scaling"] = scaling(results, sweep)
        print(scaling_table(summary["scaling"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / BENCH_FILE).write_text(json.dumps(summary, indent=1, default=str))
    print(f"mas-async: wrote {out / BENCH_FILE}")
    return out


def scaling(results: list[dict[str, Any]], sweep: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """Throughput per setting and, for a numeric single key, the efficiency against the smallest value."""
    rows = []
    key = sweep[0][0] if len(sweep) == 1 else None
    numeric = key is not None and all(isinstance(r["setting"][key], (int, float)) for r in results)
    first = min(results, key=lambda r: r["setting"][key]) if numeric else None
    for result in results:
        row = {"setting": result["setting"], "tokens_per_s": result["total"]["tokens_per_s"]}
        if first is not None and key is not None:
            scale = result["setting"][key] / first["setting"][key]
            row["efficiency"] = row["tokens_per_s"] / (scale * first["total"]["tokens_per_s"])
        rows.append(row)
    return rows


def table(config: Config, setting: dict[str, Any], result: dict[str, Any]) -> str:
    total, router, split = result["total"], result["router"], result["episode_time"]
    title = ", ".join(f"{k}={v}" for k, v in setting.items()) or "as configured"
    lines = [
        f"rollout throughput ({title}): {total['seconds']:.2f} s measured, {total['episodes_per_s']:.2f} episodes/s, "
        f"{total['env_steps_per_s']:.1f} env steps/s, {total['dropped']:.0f} dropped",
        f"  {'policy':<16}{'tokens/s':>10}{'prompt tok/s':>14}{'requests':>10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}",
    ]
    for name, fig in [*result["policies"].items(), ("total", total)]:
        lat = fig["latency_ms"]
        lines.append(
            f"  {name:<16}{fig['tokens_per_s']:>10.0f}{fig['prompt_tokens_per_s']:>14.0f}{fig['requests']:>10d}"
            f"{lat['p50']:>9.1f}{lat['p90']:>9.1f}{lat['p99']:>9.1f}"
        )
    lines.append(
        f"  episode time {split['episode_s']:.3f} s: waiting for generation {split['waiting_for_generation_s']:.3f} s, "
        f"in the env {split['in_env_s']:.3f} s, in the router <= {split['in_router_s']:.4f} s"
    )
    lines.append(
        f"  router: {router['messages_per_s']:.0f} messages/s, {router['cpu_us_per_message']:.1f} us CPU per message"
    )
    for name, replica in result["replicas"].items():
        lines.append(
            f"  {name:<28} busy {replica['busy_fraction']:.2f}, mean batch {replica['mean_batch_sequences']:.1f} "
            f"sequences ({replica['batches']} batches)"
        )
    for name, proc in sorted(result["processes"].items()):
        cpu = proc["cpu_s"] / max(1e-9, proc["wall_s"])
        lines.append(
            f"  {name:<28} CPU {proc['cpu_s']:.1f} s ({cpu:.0%} of its life), peak RSS {proc['max_rss_mb']:.0f} MB"
        )
    for policy, alone in result.get("baseline", {}).items():
        lines.append(
            f"  baseline {policy}: engine alone {alone['tokens_per_s']:.0f} tokens/s; overhead ratio (median phase, "
            f"framework / engine alone) {alone['overhead_ratio']:.3f}"
        )
    return "\n".join(lines)


def scaling_table(rows: list[dict[str, Any]]) -> str:
    lines = ["scaling:"]
    for row in rows:
        setting = ", ".join(f"{k}={v}" for k, v in row["setting"].items())
        efficiency = f"   efficiency {row['efficiency']:.2f}" if "efficiency" in row else ""
        lines.append(f"  {setting:<40} {row['tokens_per_s']:>10.0f} tokens/s{efficiency}")
    return "\n".join(lines)
