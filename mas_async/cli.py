"""The `mas-async` command line: `mas-async train CONFIG [section.key=value ...]`, `mas-async eval ...`.

Thin by design: it parses arguments, loads and validates the config (a mistake is one sentence naming
the key and the file, exit status 2) and hands over to the launcher.
"""

from __future__ import annotations

import argparse
import sys

from mas_async.config import ConfigError, load_config
from mas_async.registry import RegistryError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mas-async", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job: every process on this machine")
    train.add_argument("config", help="YAML run config, e.g. configs/plan_path_tiny.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.batch_size=8")
    evaluate = sub.add_parser("eval", help="evaluate checkpointed policies on the test split (avg@k, pass@k)")
    evaluate.add_argument("config", help="YAML run config (the env, agents and policies to evaluate)")
    evaluate.add_argument(
        "overrides", nargs="*", help="checkpoint=RUN_DIR (its last checkpoint), eval.k=8, eval.greedy=false, ..."
    )
    args = parser.parse_args(argv)

    if args.command in ("train", "eval"):
        from mas_async.launcher import launch

        overrides = [f"eval.{o}" if o.startswith("checkpoint=") else o for o in args.overrides]
        try:
            config = load_config(args.config, overrides)
            return launch(config, mode=args.command)
        except (ConfigError, RegistryError) as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
