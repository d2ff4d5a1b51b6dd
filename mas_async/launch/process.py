"""Entry point of one process of a deployment:
`python -m mas_async.launch.process ROLE RUN_DIR [--index I] [--policy P] [--roles MODULE:ATTR] [--options JSON]`.

The launcher starts one of these per role instance. It reads the resolved config and deployment.json
from the run directory, sets up logging (every line carries the role and id), builds the actor with the
role's factory from the role map (`mas_async.launch.roles.ROLES` unless `--roles` names another) and
runs it. An exception is caught here, at the process boundary: it is logged with its traceback and the
process exits with status 1, which the launcher reports with the tail of this process's log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from mas_async.launch.roles import DEFAULT_ROLES
from mas_async.runtime.run_failed import RUN_FAILED_STATUS, RunFailed


def quiet_progress_bars() -> None:
    """Progress bars of libraries would be lines without the role and id: off, before the libraries are
    imported (they read it then)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def setup_logging(name: str) -> None:
    # Warnings of libraries go through logging, so they carry the role and id too.
    quiet_progress_bars()
    logging.captureWarnings(True)
    logging.basicConfig(
        level=os.environ.get("MAS_ASYNC_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def process_name(role: str, index: int, policy: str) -> str:
    """The peer id of a role instance: router, env_worker/I, inference/P/I, trainer/P (rank 0), trainer/P/R."""
    if role == "router":
        return "router"
    if role == "trainer":
        from mas_async.peer_names import trainer_peer

        return trainer_peer(policy, index)
    return "/".join(str(p) for p in (role, policy, index) if p != "")


def load_roles(path: str) -> dict:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mas_async.launch.process")
    parser.add_argument("role")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--policy", default="")
    parser.add_argument("--roles", default=DEFAULT_ROLES, help="role -> factory map, as MODULE:ATTR")
    parser.add_argument("--options", default="{}", help="JSON keyword arguments for the role's factory")
    args = parser.parse_args(argv)
    name = process_name(args.role, args.index, args.policy)
    setup_logging(name)
    log = logging.getLogger("mas_async")
    try:
        from mas_async.config import load_config
        from mas_async.deployment import Deployment
        from mas_async.runtime.curve import SECRET_ENV, own_secret

        if SECRET_ENV in os.environ:  # taken out of the environment before anything can be started
            own_secret()

        roles = load_roles(args.roles)
        if args.role not in roles:
            raise SystemExit(f"unknown role {args.role!r} in {args.roles} (known: {', '.join(roles)})")
        config = load_config(args.run_dir / "config.yaml")
        deployment = Deployment.load(args.run_dir / "deployment.json")
        factory = roles[args.role]
        actor = factory(
            config, deployment, args.run_dir, index=args.index, policy=args.policy, **json.loads(args.options)
        )
        actor.run()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            return 130
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, RunFailed):  # (the cause is in its message; the router's own stack says nothing)
            log.error("%s failed: %s: %s", name, type(e).__name__, e)
            return RUN_FAILED_STATUS
        log.exception("%s failed: %s", name, e)
        return 1
    log.info("%s exited cleanly", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
