"""What starting a sandbox run costs: runs forked by the zygote (in one bubblewrap sandbox) against a
fresh sandbox per run (`bwrap ... python -I -S child.py`), and both against the raw baseline, a bare
interpreter with no sandbox at all (`python -I -S`, the program run as it is): fresh minus bare is what
bubblewrap and the run's own namespaces cost a run. Measured in the same run.

Two programs: a trivial one (the start cost alone) and the code env's function-test harness in its
record mode (`mas_async/sandbox/harness.py`, the program's half of `run_tests`) on the reference solution of
the first of the project's own problems, its 4 tests. Each round runs
`--runs` of them, `--concurrency` at a time (an env worker overlaps its runs), once per way, in
alternating order. Figures per way: CPU milliseconds per run (the whole machine's busy time, so every
process a run touches: a quiet machine is needed; the idle background is printed) and runs per second; the ratios are fresh over
zygote, median and range over the rounds.

    python bench/sandbox_start.py              # 5 rounds of 64 runs per program, about a minute
    python bench/sandbox_start.py --smoke      # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine_cpu import background, cpu_seconds
from envs.code_data import load_own
from mas_async.sandbox import isolation_available, run_python
from mas_async.sandbox.tests import HARNESS, calls_only

WAYS = {"zygote": True, "fresh": False, "bare": None}


def programs() -> dict[str, Any]:
    """name -> an async function running one program in the sandbox, given `zygote`."""
    problem = load_own()[0]
    job = {"mode": "record", "nonce": "0" * 16, "program": problem["solution"], "entry": problem["entry_point"]}
    job |= {"per_test_s": 2.0, "tests": [calls_only(t["code"]) for t in problem["tests"]]}
    harness = HARNESS.replace('with open("job.json") as f:', "if True:").replace("job = json.load(f)", f"job = {job!r}")
    harness = harness.replace('    os.remove("job.json")\n', "")

    async def run(code: str, zygote: bool | None) -> str | None:
        if zygote is not None:
            result = await run_python(code, zygote=zygote)
            return result.stdout if result.ok else None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", code, stdout=asyncio.subprocess.PIPE, cwd="/tmp", env={}
        )
        out, _ = await proc.communicate()
        return out.decode() if proc.returncode == 0 else None

    async def trivial(zygote: bool | None) -> bool:
        return await run("print(sum(range(1000)))", zygote) == "499500\n"

    async def function_tests(zygote: bool | None) -> bool:
        out = await run(harness, zygote)
        return out is not None and out.count('"calls"') == len(problem["tests"])  # every test recorded

    return {"trivial": trivial, "function tests": function_tests}


async def one_round(program, zygote: bool | None, runs: int, concurrency: int) -> tuple[float, float]:
    """(CPU ms per run, runs per second) of `runs` runs, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def run() -> bool:
        async with gate:
            return await program(zygote)

    await program(zygote)  # the zygote is started (and warm) before the clock
    cpu, start = cpu_seconds(), time.perf_counter()
    results = await asyncio.gather(*(run() for _ in range(runs)))
    wall = time.perf_counter() - start
    if not all(results):
        raise RuntimeError("bench/sandbox_start.py: a run failed; the figures would not be comparable")
    return (cpu_seconds() - cpu) / runs * 1000.0, runs / wall


def measure(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, program in programs().items():
        per_way: dict[str, dict[str, list[float]]] = {way: {"cpu_ms": [], "runs_per_s": []} for way in WAYS}
        for index in range(args.rounds):
            order = list(WAYS) if index % 2 == 0 else list(reversed(WAYS))
            for way in order:
                cpu_ms, rate = asyncio.run(one_round(program, WAYS[way], args.runs, args.concurrency))
                per_way[way]["cpu_ms"].append(cpu_ms)
                per_way[way]["runs_per_s"].append(rate)
        zygote, fresh, bare = per_way["zygote"], per_way["fresh"], per_way["bare"]
        cpu_ratio = [f / z for f, z in zip(fresh["cpu_ms"], zygote["cpu_ms"], strict=True)]
        rate_ratio = [z / f for f, z in zip(fresh["runs_per_s"], zygote["runs_per_s"], strict=True)]
        bwrap_ms = [f - b for f, b in zip(fresh["cpu_ms"], bare["cpu_ms"], strict=True)]
        figures[name] = {**per_way, "cpu_ratio": cpu_ratio, "rate_ratio": rate_ratio, "bwrap_cpu_ms": bwrap_ms}
    return figures


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"sandbox start: isolated runs, {args.rounds} rounds of {args.runs} runs, {args.concurrency} at a time; "
        "median (range)"
    )
    print(f"  {'program':<15} {'way':<7} {'CPU ms/run':>22} {'runs/s':>22}")
    programs = {name: ways for name, ways in figures.items() if name != "background_cpu_per_s"}
    for name, ways in programs.items():
        for way in WAYS:
            print(f"  {name:<15} {way:<7} {_spread(ways[way]['cpu_ms']):>22} {_spread(ways[way]['runs_per_s']):>22}")
    for name, ways in programs.items():
        print(
            f"zygote ratio, {name}: CPU per run {_spread(ways['cpu_ratio'])}x less, "
            f"runs/s {_spread(ways['rate_ratio'])}x (fresh sandbox = 1); a fresh sandbox costs "
            f"{_spread(ways['bwrap_cpu_ms'])} ms of CPU more than a bare interpreter (bubblewrap and the namespaces)"
        )
    print(f"background before the rounds: {figures['background_cpu_per_s'] * 1000:.0f} ms of CPU per second, idle")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=64, help="runs per round and way")
    p.add_argument("--rounds", type=int, default=5, help="rounds (each runs both ways, alternating order)")
    p.add_argument("--concurrency", type=int, default=8, help="runs in flight at a time")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args()
    if args.smoke:
        args.runs, args.rounds = 8, 1
    if not isolation_available():
        sys.exit("bench/sandbox_start.py: bubblewrap cannot isolate runs here (see docs/sandbox.md)")
    idle = background()
    figures = measure(args)
    figures["background_cpu_per_s"] = idle
    report(figures, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
