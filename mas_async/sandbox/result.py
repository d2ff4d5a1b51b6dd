"""What a sandbox run may use (`Limits`), how it ended (`SandboxResult`), and the refusal to run at all
(`SandboxUnavailable`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class SandboxUnavailable(RuntimeError):
    """No isolation is available here and the config did not say `sandbox.unsafe_no_isolation: true`;
    the message says what to install."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Defaults suit a unit-test program; `timeout_s` is wall-clock seconds."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # address space of each of its processes (and the run's cgroup, if any)
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20  # the work dir's tmpfs
    processes: int = 32  # processes and threads of the run, together
    open_files: int = 256
    output_bytes: int = 1 << 20  # kept per stream; more than this kills the program

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"sandbox Limits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. status: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock),
    "killed" (a signal: CPU or memory limit, or too much output); `detail` says why in a phrase.
    `isolated`: the run was in bubblewrap (False only under `sandbox.unsafe_no_isolation`)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    detail: str = ""
    truncated: bool = False
    isolated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"
