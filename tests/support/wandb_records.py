"""Read a W&B run file (run-<id>.wandb) back without a W&B server: the history rows and config it holds.

wandb 0.31 ships no Python reader of its own run files (its `wandb-core` writes and syncs them), so this
parses the format it writes: a 7-byte header (":W&B", magic 0xBEE1 little-endian, version 0) and then
LevelDB's log format, blocks of 32 KiB whose chunks are [CRC (4, LE)] [length (2, LE)] [type (1): full,
first, middle, last] [data], where W&B's CRC is the plain CRC-32 (zlib's) of type and data, not LevelDB's
masked CRC-32C; each record is a `wandb_internal_pb2.Record` protobuf
(wandb's own message classes decode them). Every chunk's CRC is checked, so a misread fails loudly.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The serialised records of a .wandb file, in order."""
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    out: list[bytes] = []
    pending: bytearray | None = None
    pos = len(HEADER)
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break  # the writer's last chunk, cut short: not a complete record
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            raise ValueError(f"{path}: bad CRC at byte {pos}")
        pos += 7 + length
        if kind == FULL:
            out.append(bytes(chunk))
        elif kind == FIRST:
            pending = bytearray(chunk)
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending += chunk
            if kind == LAST:
                out.append(bytes(pending))
                pending = None
        else:
            raise ValueError(f"{path}: unexpected chunk type {kind} at byte {pos}")
    return out


def read_run(path: Path) -> dict[str, Any]:
    """{"history": [row, ...], "config": {...}, "run": Record.run} of a .wandb file; each history row maps
    the logged keys to their values (wandb's own `_step`, `_runtime`, `_timestamp` left out)."""
    from wandb.proto import wandb_internal_pb2

    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    run = None
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
            history.append(row)
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":  # the run record carries the config given to wandb.init
            run = record.run
            for item in run.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"history": history, "config": config, "run": run}
