"""The router's word to the launcher about a process it declared lost while that process may still run.

A peer silent past `cluster.peer_timeout_s` is hung, stopped or cut off: it may never read the Shutdown
the router sends it, and as long as it runs the launcher sees nothing to restart. So the router appends
one JSON line per such peer to `RUN_DIR/lost_peers.jsonl` ({"name", "pid", "at", "why"}) and the
launcher, which watches that file, kills the named process; from then on it is a lost process like one
that died (docs/faults.md). The run folder is shared by every node of a run, like its metrics.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LOST_PEERS_FILE = "lost_peers.jsonl"


def record_lost_peer(run_dir: Path, name: str, pid: int, why: str) -> None:
    """Router side: say that process `name` (`pid`, as its Hello said) is lost and must not run on."""
    line = json.dumps({"name": name, "pid": pid, "at": time.time(), "why": why})
    with (run_dir / LOST_PEERS_FILE).open("a") as f:
        f.write(line + "\n")


class LostPeers:
    """Launcher side: the records appended since the reader was made (earlier ones concern processes of an
    earlier start of the run)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOST_PEERS_FILE
        self.offset = self.path.stat().st_size if self.path.exists() else 0

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
