"""The peer ids of a run's processes: their socket identities at the router and the names every table of a
run is keyed by (deployment.json's places, the GPU plan, `cluster.slurm.gpus`, logs).

router, env_worker/I, inference/P/R (replica R of policy P: `mas_async.placement.replica_names` lists them),
trainer/P (rank 0 of P's trainer), trainer/P/R (rank R >= 1). The lowest room of the framework: it imports
nothing of it, so the config, the placement and the deployment all spell the names alike.
"""

from __future__ import annotations


def trainer_peer(policy: str, rank: int = 0) -> str:
    """The peer id (socket identity) of trainer rank `rank` of `policy`: trainer/P, then trainer/P/R."""
    return f"trainer/{policy}" if rank == 0 else f"trainer/{policy}/{rank}"


def trainer_rank(peer: str) -> int:
    """The rank of a trainer peer id (`trainer_peer`'s inverse)."""
    parts = peer.split("/")
    return int(parts[2]) if len(parts) > 2 else 0


def role_and_policy(peer: str) -> tuple[str, str]:
    """A peer id's role and policy: ("trainer", "P") for trainer/P/R, ("inference", "P") for inference/P/R,
    ("router", "") for the router; an env worker's second part is its index, not a policy."""
    role, *rest = peer.split("/")
    return role, rest[0] if rest else ""
