"""Following RUN_DIR/metrics.jsonl as the router appends to it: each read returns only the rows since the last.

The launcher's progress display polls the file about once a second for the whole run; reading it whole at
every poll costs time and memory that grow with the run. `MetricsTail` remembers the byte offset after the
last complete line it parsed and reads from there. A last line without its newline is being written: it is
left for the next read. The router replaces the file when a whole-run restart resumes from a checkpoint
(`mas_async.metrics.keep_rows_before` writes the rows it keeps to a new file, then renames it over the old
one): a new inode, or a size below the offset, means the file was rewritten, and the read starts again at
its first byte and says so, so the caller can drop what it derived from the old file instead of counting
those rows twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsTail:
    """The rows appended to a metrics.jsonl since the previous `read` (none while the file does not exist)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        """Bytes of the file consumed: the end of the last complete line read."""
        self.inode: int | None = None
        """The inode of the file read last (None before the first read that found it)."""

    def read(self, max_rows: int | None = None) -> tuple[bool, list[dict[str, Any]]]:
        """(rewritten, rows): the complete rows after the offset, at most `max_rows` of them (the rest are
        for the next read: a long file read again from its start costs a bounded batch at a time). `rewritten`
        is True when the file was replaced or truncated since the previous read; `rows` then start at its
        first line. A complete line that is not JSON is skipped, as `mas_async.metrics.read_metrics` does."""
        try:
            file = self.path.open("rb")
        except FileNotFoundError:
            return False, []
        with file:
            status = os.fstat(file.fileno())
            rewritten = self.inode is not None and (status.st_ino != self.inode or status.st_size < self.offset)
            if rewritten:
                self.offset = 0
            self.inode = status.st_ino
            file.seek(self.offset)
            rows = []
            for line in file:
                if max_rows is not None and len(rows) >= max_rows:
                    break
                if not line.endswith(b"\n"):  # still being written: read again next time, whole
                    break
                self.offset += len(line)
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rewritten, rows
