"""The router's record of lost processes and what recovering from them cost, one metrics row at a time.

A process replaced alone is counted at the first word of its restart: the launcher's record
(`lost_peers.py`; every restart has one, also of a process that never said Hello or whose replacement is
still loading) or its replacement's Hello, whichever the router reads first; both carry when the lost
process was found dead, which makes the restart counted once. Its recovery starts with the Hello. A whole run restarted from a checkpoint is counted by the new router (the launcher tells it
which role was lost, and when). Recovery is timed from that death to the first result of the
replacement: an episode done by the restarted env worker, a generate result of the restarted replica,
or any episode done in the restarted run. Keys:
`faults/restarts/<role>`, `faults/reissued_episodes`, `faults/reissued_requests`,
`faults/recovery_s` (the longest recovery completed in the iteration, 0 if none), reported per
iteration (docs/faults.md). A run restarted from a checkpoint writes the later rows again; the restarts
and reissued episodes those rows reported are carried into its first row, so each is counted once.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from mas_async.metrics import Keys

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.deployment import Deployment

ROLES = ("env_worker", "inference", "trainer", "router")
"""Every role has its restart count in every row, so rows keep one shape."""

RUN_RESTART = b"(the run)"
"""The replacement of a whole run: recovered at its first finished episode, whoever ran it."""

RUN_RESTART_ENV = "MAS_ASYNC_RUN_RESTART"
"""Set by the launcher for a run it restarted from a checkpoint: JSON {"role": lost role, "died_at": unix time}."""


def replaced_alone(config: Config, deployment: Deployment, peer: str) -> bool:
    """Is a lost process `peer` ("env_worker/0", "inference/p/1", ...) started again by itself while the run
    goes on? An env worker always; an inference replica unless one of the policies it serves receives its
    weights by CUDA IPC (whose shared buffers are not re-formed; the deployment decided the backends). A
    lost trainer or router restarts the whole run."""
    role, *rest = peer.split("/")
    if role == "env_worker":
        return True
    if role != "inference":
        return False
    served = config.served_policies(rest[0], deployment.training)
    return not deployment.training or all(deployment.weight_backend(config, p) != "cuda_ipc" for p in served)


def run_restart_from_env() -> tuple[str, float] | None:
    """(lost role, when it was found dead) when this router's run is a restart, else None."""
    raw = os.environ.get(RUN_RESTART_ENV)
    if not raw:
        return None
    restart = json.loads(raw)
    return str(restart["role"]), float(restart["died_at"])


class FaultLog:
    """Restarts, reissued work and recovery times since the last row."""

    def __init__(self) -> None:
        self.restarts: Counter[str] = Counter()
        self.reissued_episodes = 0
        self.reissued_requests = 0
        self.recovery_s: list[float] = []
        self._recovering: dict[bytes, float] = {}
        """Identity of a replacement (or RUN_RESTART) -> unix time its predecessor was found dead."""
        self._counted: set[tuple[str, float]] = set()
        """(process name, when it was found dead) of every restart counted."""

    def restarted(self, role: str, died_at: float, identity: bytes = RUN_RESTART) -> None:
        """The whole run restarted after losing a `role` process at `died_at`."""
        self.restarts[role] += 1
        self._recovering[identity] = died_at

    def replaced(self, name: str, died_at: float) -> None:
        """The launcher restarted process `name`, found dead at `died_at`: counted once, whether its record or
        its replacement's Hello says so first."""
        if (name, died_at) not in self._counted:
            self._counted.add((name, died_at))
            self.restarts[name.split("/")[0]] += 1

    def replacement_joined(self, identity: bytes, died_at: float) -> None:
        """The replacement of a process found dead at `died_at` joined: counted (if its record was not read
        yet), and its recovery ends at its first result."""
        self.replaced(identity.decode(), died_at)
        self._recovering[identity] = died_at

    def carry(self, rows: list[dict[str, Any]]) -> None:
        """Count the faults of rows that a restarted run writes again (it went back to a checkpoint before
        them): they happened, and the rows that reported them are gone."""
        for row in rows:
            for role in ROLES:
                self.restarts[role] += int(row.get(Keys.restarts(role), 0))
            self.reissued_episodes += int(row.get(Keys.REISSUED_EPISODES, 0))
            self.reissued_requests += int(row.get(Keys.REISSUED_REQUESTS, 0))

    def reissued(self, episodes: int) -> None:
        """Episodes of a lost env worker went back to the queue, to run again from their start."""
        self.reissued_episodes += episodes

    def reissued_to_replicas(self, requests: int) -> None:
        """Generate requests of a lost inference replica were sent again to a live one (or wait for one)."""
        self.reissued_requests += requests

    def recovering(self, identity: bytes) -> bool:
        """Is `identity` a replacement whose first result is still to come?"""
        return identity in self._recovering

    def result_from(self, identity: bytes) -> float | None:
        """An episode finished on `identity`: the recovery time if this ends one, else None."""
        died_at = self._recovering.pop(identity, None) or self._recovering.pop(RUN_RESTART, None)
        if died_at is None:
            return None
        seconds = max(0.0, time.time() - died_at)
        self.recovery_s.append(seconds)
        return seconds

    def take(self) -> dict[str, Any]:
        """This row's faults/* metrics; counting starts again from zero."""
        row: dict[str, Any] = {Keys.restarts(role): self.restarts[role] for role in ROLES}
        row[Keys.REISSUED_EPISODES] = self.reissued_episodes
        row[Keys.REISSUED_REQUESTS] = self.reissued_requests
        row[Keys.RECOVERY_S] = max(self.recovery_s, default=0.0)
        self.restarts, self.reissued_episodes, self.reissued_requests, self.recovery_s = Counter(), 0, 0, []
        return row
