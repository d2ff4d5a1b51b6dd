"""The child side of the sandbox (`envs/sandbox.py`): isolate, drop privileges, run the model's program.

Never imported by the framework: the parent runs it as a script, `python -I sandbox_child.py CONFIG`
(CONFIG is one JSON argument), inside the process group the parent kills at the end. It uses the
standard library only, and does its work in this order:

1. Isolated mode (root and `unshare` available): the parent started this interpreter as PID 1 of fresh
   mount, network and PID namespaces (`unshare --mount --net --pid --fork --mount-proc`). This process
   reads the program's files, then mounts fresh, size-capped tmpfs over every world-writable directory
   (/tmp, /var/tmp, /dev/shm, /run/lock) and over every directory the sandbox user could not traverse
   anyway (e.g. /root), binding back only the interpreter's own directories (prefix, sys.path); then it
   mounts a tmpfs of `disk_bytes` at the work dir and writes the files into it. Nothing it writes can
   reach the host's disk; the network namespace has only a loopback that is down. It then forks the
   program and stays as a minimal init: it waits for the program and exits with its status (128 + the
   signal when killed); when it exits the kernel kills everything left in the namespace.
2. The program's process sets the rlimits (CPU seconds, address space, file size, process count,
   open files, no core dumps), in isolated mode drops to the per-run uid/gid the parent chose (no
   supplementary groups, no_new_privs, so setuid binaries cannot regain root), and installs an audit
   hook that refuses socket creation and program execution (os.exec*, os.system, subprocess,
   posix_spawn): a second barrier in isolated mode and the only network barrier in basic mode.
3. Basic mode (no root): same rlimits (the process count as a best effort: the user's current count
   plus the limit) and the audit hook also refuses writes outside the work dir and reads of other
   processes' /proc entries. Audit hooks can be bypassed with ctypes, so basic mode is a best effort;
   the parent logs a warning when it has to use it.
4. It runs the program with `runpy.run_path` as `__main__`, from the work dir.
"""

import ctypes
import json
import os
import resource
import stat
import sys

MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 2, 4, 4096, 16384
PR_SET_NO_NEW_PRIVS = 38
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
EXEC_EVENTS = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn")
WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink")
WRITE_EVENTS += ("os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    ]
    if _libc.mount(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: mount {source} on {target} failed: {os.strerror(errno)}")


def _blocked_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` (or `path`) that a stranger cannot traverse, if any."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not mode & 0o001:
            return current
    return None


def _isolate(config: dict) -> None:
    """Mount namespace setup (we are root in fresh namespaces; mounts never reach the host)."""
    workdir = config["workdir"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    paths = [p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p]
    runtime = {os.path.abspath(p) for p in paths} | {os.path.realpath(p) for p in paths}
    runtime = sorted(p for p in runtime if os.path.isdir(p))
    hide = {d: "mode=1777,size=16m" for d in WORLD_WRITABLE if os.path.isdir(d) and os.stat(d).st_mode & 0o002}
    for path in runtime:
        blocked = _blocked_ancestor(path)
        if blocked is not None and not any(blocked.startswith(h + "/") for h in hide):
            hide.setdefault(blocked, "mode=0755,size=1m")
    expose = []  # runtime paths under a hidden dir, with an O_PATH fd opened before hiding
    for path in runtime:
        if any(path == h or path.startswith(h + "/") for h in hide):
            if not any(path.startswith(p + "/") for p, _ in expose):
                expose.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    for directory in sorted(hide, key=len):
        _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, hide[directory])
    for path, fd in expose:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.makedirs(workdir, exist_ok=True)
    uid, gid = config["uid"], config["gid"]
    size = config["limits"]["disk_bytes"]
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,uid={uid},gid={gid},size={size}")
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)


def _process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _set_limits(limits: dict, isolated: bool) -> None:
    cpu = limits["cpu_s"]
    processes = limits["processes"] if isolated else _process_count() + limits["processes"]
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits["memory_bytes"], limits["memory_bytes"]),
        ("RLIMIT_FSIZE", limits["file_size_bytes"], limits["file_size_bytes"]),
        ("RLIMIT_NPROC", processes, processes),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: prctl(PR_SET_NO_NEW_PRIVS) failed")


def _audit_hook(workdir: str, guard_files: bool):
    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # an already open fd
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        full = os.path.realpath(os.path.join(workdir, str(path)))
        return full == workdir or full.startswith(workdir + "/") or full.startswith("/dev/null")

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            raise PermissionError(f"sandbox: no network ({event} refused)")
        if event.startswith(EXEC_EVENTS):
            raise PermissionError(f"sandbox: running programs is not allowed ({event} refused)")
        if not guard_files:
            return
        if event == "open":
            path, _mode, flags = args
            text = os.fsdecode(path) if isinstance(path, bytes) else str(path)
            if text.startswith("/proc/") and not text.startswith(("/proc/self/", f"/proc/{os.getpid()}/")):
                raise PermissionError(f"sandbox: reading {text} is not allowed")
            if (flags or 0) & WRITE_FLAGS and not inside(path):
                raise PermissionError(f"sandbox: writing outside the work dir is not allowed ({text})")
        elif event in WRITE_EVENTS and args and not all(inside(a) for a in args[:2] if isinstance(a, str | bytes)):
            raise PermissionError(f"sandbox: changing files outside the work dir is not allowed ({event})")

    return hook


def _init(pid: int) -> int:
    """PID 1 of the namespace: reap every orphan; return the program's exit code (128 + signal)."""
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if reaped == pid:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _run(config: dict, isolated: bool) -> None:
    workdir = config["workdir"]
    _set_limits(config["limits"], isolated)
    if isolated:
        _drop_privileges(config["uid"], config["gid"])
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    sys.argv = [config["main"]]
    sys.addaudithook(_audit_hook(workdir, guard_files=not isolated))
    import runpy

    runpy.run_path(os.path.join(workdir, config["main"]), run_name="__main__")


def main() -> None:
    config = json.loads(sys.argv[1])
    isolated = config["isolated"]
    if not isolated:
        _run(config, isolated)
        return
    _isolate(config)
    pid = os.fork()
    if pid == 0:
        _run(config, isolated)
        return
    sys.stdout.flush()
    os._exit(_init(pid))


if __name__ == "__main__":
    main()
