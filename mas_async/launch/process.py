"""Entry point of one process of a deployment: `python -m mas_async.launch.process ROLE RUN_DIR [options]`.

The launcher starts one of these per role instance. It reads the resolved config and deployment.json
from the run directory, sets up logging (every line carries the role and id), builds the actor and runs
it. An exception is caught here, at the process boundary: it is logged with its traceback and the
process exits with status 1, which the launcher reports with the tail of this process's log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def setup_logging(name: str) -> None:
    # Progress bars and warnings of libraries would be lines without the role and id: bars off,
    # warnings through logging.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.captureWarnings(True)
    logging.basicConfig(
        level=os.environ.get("MAS_ASYNC_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def build_actor(role: str, run_dir: Path, index: int, policy: str):
    from mas_async.config import load_config
    from mas_async.deployment import Deployment

    config = load_config(run_dir / "config.yaml")
    deployment = Deployment.load(run_dir / "deployment.json")
    if role in ("inference", "trainer"):  # the router and env workers never need torch: start faster
        import torch

        torch.set_num_threads(config.cluster.torch_threads)
        torch.manual_seed(config.run.seed)
    if role == "router":
        from mas_async.router.hub import Router

        return Router(config, deployment, run_dir)
    if role == "env_worker":
        from mas_async.rollout.env_worker import EnvWorker

        return EnvWorker(config, deployment, index)
    if role == "inference":
        from mas_async.inference.server import InferenceServer

        return InferenceServer(config, deployment, policy, index)
    if role == "trainer":
        from mas_async.training.trainer import Trainer

        return Trainer(config, deployment, policy, run_dir)
    raise SystemExit(f"unknown role {role!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mas_async.launch.process")
    parser.add_argument("role", choices=["router", "env_worker", "inference", "trainer"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--policy", default="")
    args = parser.parse_args(argv)
    name = "/".join(str(p) for p in (args.role, args.policy, args.index) if p != "")
    if args.role in ("router", "trainer"):
        name = args.role if args.role == "router" else f"trainer/{args.policy}"
    setup_logging(name)
    log = logging.getLogger("mas_async")
    try:
        actor = build_actor(args.role, args.run_dir, args.index, args.policy)
        actor.run()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            return 130
        log.exception("%s failed: %s", name, e)
        return 1
    log.info("%s exited cleanly", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
