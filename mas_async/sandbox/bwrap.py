"""The sandbox's boundary: bubblewrap (`bwrap`, Debian's `bubblewrap`), root or not.

`command(script, fds)` is the command line that runs one of the sandbox's scripts (`child.py` for a
fresh run, `zygote.py` for the warm one) inside a bubblewrap sandbox:

- new user (unless root: root keeps its capabilities there, to give each run a uid of its own), PID,
  IPC, network (only a loopback: no network at all) and UTS namespaces. Each run then enters its own
  (`child.py`); its /proc shows its own processes only. (A user namespace may mount a /proc only where
  one is already visible: hence bubblewrap's own, which each run covers with its own);
- a root of its own, read-only (`--remount-ro /`), holding only the view (`view.py`) bound read-only,
  its hidden paths covered, a minimal /dev, a mount point for the work dir, a tmpfs /tmp, and the two
  scripts (the checkout itself stays out);
- `--die-with-parent` (nothing outlives the process that started it), `--new-session` (no terminal to
  push input into), `--clearenv` and the run's minimal environment, and the SANDBOX seccomp filter
  (`seccomp.py`) for every process in it.

`unavailable()` says in a sentence why bubblewrap cannot isolate runs here (None when it can): it is
probed once per process by starting a real sandbox. The code envs refuse to run without it unless the
config says `sandbox.unsafe_no_isolation: true` (`runner.py`).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mas_async.sandbox.view import view

SCRIPTS = Path(__file__).parent
INSIDE = "/.sandbox"  # where the scripts are, in the sandbox
WORKDIR = "/work"  # a run's work dir, in the sandbox (a tmpfs of its own per run)
INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap)"


def is_root() -> bool:
    return os.geteuid() == 0


def command(script: str, args: list[str], seccomp_fd: int) -> list[str]:
    """The bwrap command running `python -I -S INSIDE/<script> args...` in a fresh sandbox; the
    SANDBOX seccomp filter is read from `seccomp_fd` (which the caller passes on)."""
    return [*_prefix(), "--seccomp", str(seccomp_fd), sys.executable, "-I", "-S", f"{INSIDE}/{script}", *args]


@functools.cache
def _prefix() -> tuple[str, ...]:
    binary = shutil.which("bwrap")
    if binary is None:
        raise FileNotFoundError("bwrap")
    parts = [binary] if is_root() else [binary, "--unshare-user"]
    parts += ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--die-with-parent", "--new-session"]
    seen = view()
    # /tmp first: a path of the view below it (an interpreter in a temporary directory) is bound into it.
    parts += ["--tmpfs", "/tmp"]
    for path in seen.read_only:
        parts += ["--ro-bind", path, path]
    for path, target in seen.symlinks:
        parts += ["--symlink", target, path]
    for path in seen.hidden:
        parts += ["--perms", "0000", "--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    parts += ["--dev", "/dev", "--proc", "/proc", "--dir", WORKDIR]
    for name in ("child.py", "zygote.py"):
        parts += ["--ro-bind", str(SCRIPTS / name), f"{INSIDE}/{name}"]
    # The directories bubblewrap made above the bound paths (e.g. /root above a pyenv) are 0700: make
    # them traversable and nothing else (0111: not even their owner, the sandbox's user, lists them).
    above = {str(parent) for path in seen.read_only for parent in Path(path).parents if str(parent) != "/"}
    for directory in sorted(above - set(seen.read_only)):
        parts += ["--chmod", "0111", directory]
    parts += ["--remount-ro", "/", "--chdir", "/", "--clearenv"]
    return tuple(parts)


@functools.cache
def unavailable() -> str | None:
    """Why bubblewrap cannot isolate a run here, in a sentence; None when it can (probed once)."""
    if shutil.which("bwrap") is None:
        return f"the sandbox needs bubblewrap, which is not installed: {INSTALL}"
    try:
        from mas_async.sandbox.seccomp import bpf

        filter_bytes = bpf(program=False)
    except (ImportError, OSError) as error:
        return f"the sandbox's seccomp filter could not be compiled ({error}): pip install pyseccomp and libseccomp2"
    read, write = os.pipe()
    os.write(write, filter_bytes)
    os.close(write)
    # What a run's leader does first (`child.lead`): its own namespaces, a user namespace unless root.
    flags = 0x00020000 | 0x20000000 | 0x40000000 | (0 if is_root() else 0x10000000)
    probe = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nassert libc.unshare({flags}) == 0, 'unshare'"
    probe += "\nprint('ok')"
    try:
        argv = [*_prefix(), "--seccomp", str(read), sys.executable, "-I", "-S", "-c", probe]
        done = subprocess.run(argv, pass_fds=[read], capture_output=True, text=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start a sandbox here ({error})"
    finally:
        os.close(read)
    if done.returncode != 0 or done.stdout.strip() != "ok":
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return (
            f"bubblewrap could not start a sandbox here ({why}): as a user other than root it needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0, and no AppArmor rule refusing them)"
        )
    return None
