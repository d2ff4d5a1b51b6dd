"""What the router and the launcher tell each other about lost processes, one JSON line at a time.

The router to the launcher, about a process it declared lost while that process may still run: a peer
silent past `cluster.peer_timeout_s` is hung, stopped or cut off, it may never read the Shutdown the
router sends it, and as long as it runs the launcher sees nothing to restart. So the router appends one
line per such peer to `RUN_DIR/lost_peers.jsonl` ({"name", "pid", "at", "why"}) and the launcher, which
watches that file, kills the named process; from then on it is a lost process like one that died.

The launcher to the router, about a process it found dead and started again (`RUN_DIR/restarted.jsonl`,
{"name", "pid", "at": when it was found dead}, written afresh at each start of the run): the router learns of the loss at once,
not when the replacement says Hello (minutes later, for a large model) nor after a silence; and of a
process that died before it ever said Hello, which no silence would show (docs/faults.md). The run
folder is shared by every node of a run, like its metrics.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LOST_PEERS_FILE = "lost_peers.jsonl"
RESTARTED_FILE = "restarted.jsonl"


def record_lost_peer(run_dir: Path, name: str, pid: int, why: str) -> None:
    """Router side: say that process `name` (`pid`, as its Hello said) is lost and must not run on."""
    line = json.dumps({"name": name, "pid": pid, "at": time.time(), "why": why})
    with (run_dir / LOST_PEERS_FILE).open("a") as f:
        f.write(line + "\n")


def record_restart(run_dir: Path, name: str, pid: int, died_at: float) -> None:
    """Launcher side: say that process `name` (`pid`) was found dead at `died_at` (unix time, what its
    replacement's Hello says too) and started again."""
    with (run_dir / RESTARTED_FILE).open("a") as f:
        f.write(json.dumps({"name": name, "pid": pid, "at": died_at}) + "\n")


def forget_restarts(run_dir: Path) -> None:
    """Launcher side, before a start of the run: the records of an earlier start concern its processes."""
    (run_dir / RESTARTED_FILE).unlink(missing_ok=True)


class LostPeers:
    """A reader of one of these files (lost_peers.jsonl by default): the records appended since the reader
    was made (earlier ones concern processes of an earlier start of the run), or all of them with
    `from_start` (restarted.jsonl, which each start of the run begins afresh)."""

    def __init__(self, run_dir: Path, name: str = LOST_PEERS_FILE, from_start: bool = False) -> None:
        self.path = run_dir / name
        self.offset = self.path.stat().st_size if self.path.exists() and not from_start else 0

    def new(self) -> list[dict[str, Any]]:
        """Whole lines appended since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]
