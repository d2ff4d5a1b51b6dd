"""The `mas-async` command line: `mas-async train CONFIG [section.key=value ...]`.

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
    args = parser.parse_args(argv)

    if args.command == "train":
        from mas_async.launcher import launch

        try:
            config = load_config(args.config, args.overrides)
            return launch(config)
        except (ConfigError, RegistryError) as e:
            print(f"mas-async: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
