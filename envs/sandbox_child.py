"""The child side of the sandbox (`envs/sandbox.py`): isolate, drop privileges, run the model's program.

Never imported by the framework: the parent runs it as a script, `python -I -S sandbox_child.py CONFIG`
(CONFIG is one JSON argument), inside the process group the parent kills at the end; or the zygote
(`sandbox_zygote.py`) loads it once and calls `run_isolated` in each run's namespaces. It uses the
standard library only, and does its work in this order:

1. The view: what the program may read. Only the interpreter (its prefixes and the directories of its
   `sys.path`: standard library, lib-dynload, site-packages), the system's programs and shared libraries
   (/usr, /bin, /lib*), a few files of /etc the C library and the standard library read, and a few
   devices. Hidden inside that: the packages named in CONFIG's `hidden` (HumanEval, whose tests are
   answers, and the project's own packages, with the files of an editable install that point at the
   checkout) wherever a site dir holds them, and the project checkout should it lie inside the view.
   Everything else (the checkout, its datasets, the run dirs, the home dir, other runs' temp files) is
   outside it.
2. Isolated mode (root and `unshare` available): this process is PID 1 of fresh mount, network and PID
   namespaces (`unshare --mount --net --pid --fork`, or the zygote's run leader). It reads the
   program's files, then builds a new root on a small tmpfs: the view bind-mounted read-only (hidden
   directories covered by an empty unreadable tmpfs, hidden files by /dev/null), a fresh /proc for
   the PID namespace, /dev with null, zero, full, random and urandom, size-capped tmpfs for /tmp and
   /dev/shm, and a tmpfs of `disk_bytes` at the work dir (same path as outside) holding the files. It
   then moves into that root with pivot_root and detaches the old one, so no path, symlink or /proc
   entry leads back to the host's files. Nothing the program writes reaches the host's disk; the
   network namespace has only a loopback that is down. It then forks the program and stays as a
   minimal init: it waits for the program and exits with its status (128 + the signal when killed);
   when it exits the kernel kills everything left in the namespace.
3. The program's process sets the rlimits (CPU seconds, address space, file size, process count,
   open files, no core dumps), in isolated mode drops to the per-run uid/gid the parent chose (no
   supplementary groups, no_new_privs, so setuid binaries cannot regain root), and installs an audit
   hook that refuses socket creation and program execution (os.exec*, os.system, subprocess,
   posix_spawn): a second barrier in isolated mode and the only network barrier in basic mode.
4. Basic mode (no root): same rlimits (the process count as a best effort: the user's current count
   plus the limit) and the audit hook also enforces the view: it refuses opening, listing or entering
   anything outside it (symlinks resolved; relative paths with `..` refused, since a `dir_fd` could
   make them mean another place), links to files outside it, writes outside the work dir, and reads of
   other processes' /proc entries. This is a weaker guarantee: ctypes (or any C extension) calls libc
   directly past audit hooks, and stat() has no audit event, so a program can still learn which paths
   exist. The parent logs a warning when it has to use basic mode.
5. It runs the program with `runpy.run_path` as `__main__`, from the work dir.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from collections.abc import Callable, Iterable

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 32, 4096, 8192, 16384
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
# The system's programs and shared libraries (symlinks to usr/ on merged-/usr systems).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc the dynamic loader, the C library and the standard library read (time zone, users'
# names for pwd/getpass, mimetypes); nothing of the host's configuration beyond that.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf")
ETC_FILES += ("mime.types",)
DEVICES = ("null", "zero", "full", "random", "urandom")
# Site dirs of the system's other Pythons: visible under /usr, so they are searched for hidden packages too.
OTHER_SITE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")
OTHER_SITE_PARENTS = ("/usr/lib", "/usr/local/lib", "/usr/lib64", "/usr/local/lib64")
EXEC_EVENTS = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn")
WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink")
WRITE_EVENTS += ("os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move")
LIST_EVENTS = ("os.listdir", "os.scandir", "os.chdir")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    ]
    if _libc.mount(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: mount {source} on {target} failed: {os.strerror(errno)}")


def _within(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _outermost(paths: Iterable[str]) -> list[str]:
    """The paths that lie inside no other of them (a bind of the outer one shows the inner ones)."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not _within(path, kept):
            kept.append(path)
    return sorted(kept)


def _is_hidden(name: str, hidden: set[str]) -> bool:
    """Whether a site dir's entry belongs to a hidden package: the package, its .dist-info/.egg-info,
    a module of that name, or an editable install's files (a .pth and a finder naming the checkout)."""
    stem = name.split("-", 1)[0].split(".", 1)[0].lower()
    return stem in hidden or name.startswith("__editable__") or name.endswith(".egg-link")


View = tuple[list[str], list[str], dict[str, str]]


def _view(config: dict) -> View:
    """(read-only paths, hidden paths inside them, symlinks to recreate as path: target)."""
    project = os.path.realpath(config["project"])
    prefixes = {p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix) if p}
    runtime: set[str] = set()
    for entry in (*prefixes, *sys.path):
        if not entry or not os.path.exists(entry):
            continue
        for path in {os.path.abspath(entry), os.path.realpath(entry)}:
            # A path entry into the checkout (an old-style editable install) or above it stays out; a
            # prefix inside it (a virtual environment in the checkout) is needed, and shows only itself.
            if entry in prefixes or not (_within(path, [project]) or _within(project, [path])):
                runtime.add(path)
    links = []
    system = []
    for path in (*SYSTEM_DIRS, *(f"/etc/{name}" for name in ETC_FILES)):
        if os.path.islink(path):
            links.append(path)
        elif os.path.exists(path):
            system.append(path)
    # A link into the view is kept as a link (e.g. /lib -> usr/lib, /etc/localtime -> /usr/share/...);
    # one to elsewhere is bound as what it points to.
    symlinks = {p: os.readlink(p) for p in links if _within(os.path.realpath(p), _outermost([*system, *runtime]))}
    system += [p for p in links if p not in symlinks and os.path.exists(p)]
    read_only = _outermost([*system, *runtime])
    site_dirs = set(runtime) | {p for p in OTHER_SITE_DIRS if os.path.isdir(p)}
    for parent in OTHER_SITE_PARENTS:
        try:
            versions = [n for n in os.listdir(parent) if n.startswith("python")]
        except OSError:
            continue
        for version in versions:
            for kind in ("site-packages", "dist-packages"):
                if os.path.isdir(path := os.path.join(parent, version, kind)):
                    site_dirs.add(path)
    names = set(config["hidden"])
    hidden = [project] if _within(project, read_only) else []
    for directory in sorted(site_dirs):
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for name in entries:
            if _is_hidden(name, names):
                path = os.path.join(directory, name)
                if not os.path.islink(path):
                    hidden.append(path)
                elif _within(real := os.path.realpath(path), read_only):
                    hidden.append(real)  # a link out of the view dangles in it: nothing to hide there
    return read_only, _outermost(hidden), symlinks


def _make_parents(path: str) -> None:
    """The directories above `path` that it needs, created traversable but not listable (0711): e.g.
    /root shows nothing though the interpreter's prefix inside it is reachable."""
    missing = []
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        os.mkdir(directory, 0o711)


def _make_mount_point(path: str, directory: bool) -> None:
    _make_parents(path)
    if directory:
        os.makedirs(path, exist_ok=True)
    else:
        open(path, "ab").close()


def _bind(source: str, target: str, read_only: bool = True) -> None:
    _make_mount_point(target, os.path.isdir(source))
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:  # a bind mount takes its own flags only on a remount
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _enter(root: str) -> None:
    """Make `root` the root of this mount namespace and drop the old one (pivot_root), so that no path
    leads back to it; where pivot_root is refused (e.g. the machine itself runs chrooted) or its
    number is unknown, move the mount over / and chroot into it, which an unprivileged program cannot
    leave either."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and _libc.syscall(number, b".", b".") == 0:
        if _libc.umount2(b".", MNT_DETACH) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"sandbox: detaching the old root failed: {os.strerror(errno)}")
    else:
        _mount(".", "/", None, MS_MOVE)
        os.chroot(".")
    os.chdir("/")


def _isolate(config: dict, view: View | None = None) -> None:
    """Mount namespace setup (we are root in fresh namespaces; mounts never reach the host). `view`:
    `_view(config)` when the caller has it already (the zygote keeps it between runs)."""
    workdir = config["workdir"]
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    read_only, hidden, symlinks = view or _view(config)
    root = workdir  # any directory serves as the new root's mount point; this one is ours
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in read_only:
        _bind(path, root + path)
    for path, target in symlinks.items():
        _make_parents(root + path)
        os.symlink(target, root + path)
    for path in hidden:
        if os.path.isdir(path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0,size=4k")
        else:
            _mount("/dev/null", root + path, None, MS_BIND)  # e.g. an editable install's .pth: now empty
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", _mkdir(root + "/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        _bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{number}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    for path in ("/tmp", "/dev/shm"):
        _mount("tmpfs", _mkdir(root + path), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m")
    uid, gid = config["uid"], config["gid"]
    size = config["limits"]["disk_bytes"]
    target = _mkdir(root + workdir)
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,uid={uid},gid={gid},size={size}")
    _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _enter(root)
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


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


def _audit_hook(workdir: str, view: tuple[list[str], list[str]] | None) -> Callable[[str, tuple], None]:
    """The hook for the program: no network, no programs; with a `view` (basic mode, where nothing else
    stands between the program and the host's files), also reads only inside the view and writes only
    inside the work dir."""
    read_only, hidden = view or ([], [])
    readable = [os.path.realpath(p) for p in (workdir, "/proc", *(f"/dev/{name}" for name in DEVICES), *read_only)]
    unreadable = [os.path.realpath(p) for p in hidden]

    def resolve(path: object) -> str | None:
        """The absolute, symlink-free path that `path` names now; None for an open file descriptor."""
        if isinstance(path, int):
            return None  # checked when it was opened
        try:
            text = os.fsdecode(os.fspath(path)) if path is not None else "."  # type: ignore[arg-type]
        except TypeError:
            text = str(path)
        if not os.path.isabs(text) and ".." in text.split("/"):
            # A dir_fd (invisible to the hook) could anchor it anywhere the hook did not expect.
            raise PermissionError(f"sandbox: relative paths out of a directory are not allowed ({text})")
        return os.path.realpath(os.path.join(os.getcwd(), text))

    def inside(path: object) -> bool:
        full = resolve(path)
        return full is None or _within(full, [workdir]) or full == "/dev/null"

    def visible(path: object) -> bool:
        full = resolve(path)
        if full is None:
            return True
        if full.startswith("/proc/"):
            pid = full.split("/")[2]
            if pid.isdigit() and pid != str(os.getpid()):
                return False  # other processes' environment, memory, root
        return _within(full, readable) and not _within(full, unreadable)

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            raise PermissionError(f"sandbox: no network ({event} refused)")
        if event.startswith(EXEC_EVENTS):
            raise PermissionError(f"sandbox: running programs is not allowed ({event} refused)")
        if view is None:
            return
        if event == "open":
            path, _mode, flags = args
            if not visible(path):
                raise PermissionError(f"sandbox: reading {path} is not allowed")
            if (flags or 0) & WRITE_FLAGS and not inside(path):
                raise PermissionError(f"sandbox: writing outside the work dir is not allowed ({path})")
        elif event in LIST_EVENTS and not visible(args[0] if args else None):
            raise PermissionError(f"sandbox: {args[0] if args else '.'} is out of view ({event} refused)")
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


def _run(config: dict, isolated: bool, view: tuple[list[str], list[str]] | None = None) -> None:
    workdir = config["workdir"]
    _set_limits(config["limits"], isolated)
    if isolated:
        _drop_privileges(config["uid"], config["gid"])
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    sys.argv = [config["main"]]
    sys.addaudithook(_audit_hook(workdir, view))
    import runpy

    runpy.run_path(os.path.join(workdir, config["main"]), run_name="__main__")


def _without_site(site_dirs: list[str]) -> None:
    """What `site` would have given this interpreter (started with `-S`), less the .pth files: the
    site-packages directories on the path, and the builtins `exit`, `quit`, `help`, `copyright`,
    `credits` and `license` that programs may call."""
    import site

    sys.path.extend(d for d in site_dirs if d not in sys.path)
    site.setquit()
    site.setcopyright()
    site.sethelper()


def run_isolated(config: dict, view: View | None = None) -> None:
    """As PID 1 of fresh mount, network and PID namespaces: build the root, fork the program, reap as
    init and exit with the program's status. Returns only in the program's process, once it has run."""
    _isolate(config, view)
    pid = os.fork()
    if pid == 0:
        _run(config, isolated=True)
        return
    sys.stdout.flush()
    os._exit(_init(pid))


def main() -> None:
    config = json.loads(sys.argv[1])
    _without_site(config["site_dirs"])
    if config["isolated"]:
        run_isolated(config)
        return
    read_only, hidden, _symlinks = _view(config)
    _run(config, isolated=False, view=(read_only, hidden))


if __name__ == "__main__":
    main()
