"""`python -m mas_async.launch.env_check CONFIG [overrides]`: `envs.check.check_env` on a run's env and options,
and the held-out states of the run's own problems that its training problems reach (`held_out_states`). The
framework reaches the user package's checks through registry paths ("module:function"), as it reaches envs."""

from __future__ import annotations

import sys

from mas_async.api.registry import ENVS, resolve
from mas_async.config import ConfigError, load_config
from mas_async.held_out import run_problems

CHECK_ENV = "envs.check:check_env"
HELD_OUT_STATES = "envs.check:held_out_states"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print("usage: python -m mas_async.launch.env_check CONFIG [key=value ...]", file=sys.stderr)
        return 2
    try:
        config = load_config(args[0], args[1:])
    except ConfigError as e:
        print(f"env_check: {e}", file=sys.stderr)
        return 2
    env_cls = resolve(config.env.name, ENVS, "env")
    options = config.env.options
    print(resolve(CHECK_ENV, {}, "check")(env_cls, **options))
    train, test = run_problems(env_cls, config.env.train_size, config.env.test_size, options)
    turns = config.workflow.options.get("max_turns", 8)
    depth = turns * len(env_cls.possible_agents)
    held_out = resolve(HELD_OUT_STATES, {}, "check")(env_cls, train, test[: config.eval.size], depth=depth)
    print(f"the run's problems: {held_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
