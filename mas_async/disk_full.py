"""A write into the run directory that fails because its disk is full: a named error that stops the run.

A full disk is not a lost process: restarting the run from its last checkpoint would fill it again at the
next write. So a checkpoint, a metrics row or the router's position that cannot be written for lack of space
(ENOSPC, or EDQUOT for a quota) raises `DiskFull`, a `RunFailed`: the launcher stops every process at once
and shows the sentence, which names the path, its file system's free bytes and how to go on. What was
complete stays so: checkpoints are written under a temporary name and renamed when whole (mas_async/
checkpoint.py; a failed one's leftovers are removed), and a half-written metrics row is dropped when the run
resumes (`metrics.keep_rows_before`). `resume=RUN_DIR` then continues from the last complete checkpoint.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mas_async.runtime.run_failed import RunFailed

FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(RunFailed):
    """A write into the run directory found no space left (module docstring)."""


def free_bytes(path: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the file system that holds `path` (its nearest existing parent), or None."""
    for candidate in (path, *path.parents):
        try:
            usage = shutil.disk_usage(candidate)
        except OSError:
            continue
        return usage.free, usage.total
    return None


FULL_MARGIN_BYTES = 1 << 20
"""A write that failed on a file system with less free than this failed for lack of space, whatever it raised
(torch.save says so with a RuntimeError of its zip writer, not an OSError)."""


def as_disk_full(error: BaseException, path: Path) -> OSError | None:
    """An OSError(ENOSPC) for `error` if it is one, or if the file system of `path` is (nearly) full now; else None.
    Ask before removing what the failed write left: that frees the space again."""
    if isinstance(error, OSError):
        return error if error.errno in FULL else None
    usage = free_bytes(path)
    if usage is not None and usage[0] < FULL_MARGIN_BYTES:
        return OSError(errno.ENOSPC, f"No space left on device ({type(error).__name__}: {error})", str(path))
    return None


@contextmanager
def named_if_full(what: str, path: Path, run_dir: Path) -> Iterator[None]:
    """Run the block that writes `what` at `path`; an OSError of a full disk becomes `DiskFull`, naming them."""
    try:
        yield
    except OSError as error:
        if error.errno not in FULL:
            raise
        usage = free_bytes(path)
        room = f"{usage[0]:,} of {usage[1]:,} bytes free" if usage is not None else "its free space unknown"
        raise DiskFull(
            f"no space left writing {what} at {path} ({room} on its file system: {error.strerror}). "
            "The last complete checkpoint is intact; free space there, then continue the run with "
            f"`mas-async train CONFIG resume={run_dir}`"
        ) from error
