"""A write that finds no space is named (`DiskFull`, a RunFailed: no restart), whatever raised it: an OSError of
ENOSPC or EDQUOT, or torch.save's RuntimeError on a file system left without room; any other error passes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from mas_async import disk_full
from mas_async.disk_full import DiskFull, as_disk_full, named_if_full
from mas_async.runtime.run_failed import RunFailed


def test_an_enospc_write_becomes_a_named_error_with_the_path_and_how_to_go_on(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(DiskFull) as caught, named_if_full("the metrics row of iteration 7", path, tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
    text = str(caught.value)
    assert isinstance(caught.value, RunFailed)
    assert f"no space left writing the metrics row of iteration 7 at {path}" in text
    assert "bytes free" in text and f"resume={tmp_path}" in text


def test_other_errors_pass_as_they_are(tmp_path: Path):
    with pytest.raises(PermissionError), named_if_full("x", tmp_path, tmp_path):
        raise PermissionError(errno.EACCES, "Permission denied")
    assert as_disk_full(RuntimeError("zip writer failed"), tmp_path) is None  # (this disk has room)


def test_a_runtime_error_on_a_full_file_system_counts_as_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(disk_full, "free_bytes", lambda path: (4096, 10 << 20))
    full = as_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos"), tmp_path)
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC and "RuntimeError" in str(full)
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert as_disk_full(quota, tmp_path) is quota
