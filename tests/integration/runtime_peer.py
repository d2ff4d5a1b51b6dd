"""A minimal Peer for the runtime tests: `python -m tests.integration.runtime_peer ENDPOINT`.

Its main() makes one blocking call in a thread (as a torch.distributed collective would be made) and
then waits for the router's Shutdown; it logs how many malformed messages it dropped."""

from __future__ import annotations

import asyncio
import sys
import time

from mas_async.runtime.actor import Peer


class SleepyPeer(Peer):
    role = "env_worker"

    async def main(self) -> None:
        await asyncio.to_thread(time.sleep, 3.0)  # blocking work off the loop: heartbeats go on
        await self.stopping.wait()

    async def on_message(self, msg) -> None:
        pass

    async def cleanup(self) -> None:
        print(f"malformed={self.malformed}", flush=True)


if __name__ == "__main__":
    SleepyPeer("env_worker/7", sys.argv[1], capacity=3, heartbeat_s=0.2, peer_timeout_s=float(sys.argv[2])).run()
