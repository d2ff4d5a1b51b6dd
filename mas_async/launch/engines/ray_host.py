"""The Ray actor that runs one process of a run on its node: the Ray engine starts one per placement-group
bundle (`mas_async.launch.engines.ray`), and the launcher reaches the process only through it.

It reports its node (IP and Ray node id), finds free ports there, starts the process with `Popen` in a
session of its own (so a signal reaches everything the process started), and answers poll, signal and
wait. The process is its child: when the actor dies, the process's parent changes and the process shuts
itself down (`Actor._watch_parent`, which watches this actor's pid, given as `PARENT_PID_ENV`, even if the
actor died before the process got that far); `stop` kills the process group when the engine closes.

Stdlib only at import: a Ray worker imports this module to build the actor, and must do so quickly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


class ProcessHost:
    """Runs one process on the node Ray placed this actor on; one process per actor."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node(self) -> tuple[str, str]:
        """(IP address, Ray node id) of this actor's node."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_ports(self, host: str, count: int) -> list[int]:
        from mas_async.deployment import free_ports

        return free_ports(host, count)

    def start(self, command: list[str], env: dict[str, str], log_path: str, cwd: str) -> int:
        """Start `command` in `cwd` with this worker's environment plus `env`, output appended to
        `log_path`; its pid."""
        from mas_async.runtime.actor import PARENT_PID_ENV

        if self.proc is not None and self.proc.poll() is None:  # one at a time: a lost one is started again
            raise RuntimeError(f"this ProcessHost still runs pid {self.proc.pid}")
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
                env={**os.environ, **env, PARENT_PID_ENV: str(os.getpid())},
            )
        # Ray runs its workers at a low priority (niceness 15) and the process would inherit it: give it
        # the normal one back where the node allows (raising priority needs root).
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, 0)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        """Send `sig` to the process's group (what it started too); nothing if none is left."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """Kill the process group now (the engine is closing) and reap the process; its exit status."""
        self.signal(signal.SIGKILL)
        return self.wait(5.0)
