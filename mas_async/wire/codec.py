"""msgpack encoding of wire frames, with packed binary arrays and bounded decoding.

A message is a list of ZeroMQ frames: `[kind (1 byte)] [header (msgpack)] [payload (msgpack)]`.
numpy arrays travel as msgpack ext type 1 (a dtype code byte followed by the raw little-endian bytes),
never as lists of Python numbers. Decoding is bounded: a frame larger than `MAX_FRAME_BYTES`, or one whose
strings, arrays or maps exceed the limits below, raises `CodecError`, as does any malformed input; the
caller counts it and drops it (or replies with an error), it never crashes a process. Never pickle.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

ARRAY_EXT = 1
MAX_FRAME_BYTES = 512 << 20
"""Largest frame accepted by `unpack` (and by the sockets' ZMQ_MAXMSGSIZE)."""
MAX_HEADER_BYTES = 64 << 10
"""Headers are small routing records; anything larger is malformed."""

# dtype code byte <-> numpy dtype (little-endian). Codes are only ever appended.
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i4"),
    2: np.dtype("<f4"),
    3: np.dtype("<i8"),
    4: np.dtype("<f8"),
    5: np.dtype("u1"),
    6: np.dtype("<f2"),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CodecError(ValueError):
    """A frame that cannot be decoded: malformed, oversized or of an unknown type."""


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        code = _CODES.get(obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype)
        if code is None:
            raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent; use one of {list(_CODES)}")
        return msgpack.ExtType(ARRAY_EXT, bytes([code]) + np.ascontiguousarray(obj, _DTYPES[code]).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT or not data:
        raise CodecError(f"unknown msgpack ext type {code}")
    dtype = _DTYPES.get(data[0])
    if dtype is None or (len(data) - 1) % dtype.itemsize:
        raise CodecError(f"malformed array ext (dtype code {data[0]}, {len(data) - 1} bytes)")
    return np.frombuffer(data, dtype=dtype, offset=1)


def pack(obj: Any) -> bytes:
    """Encode any msgpack-able value; numpy arrays become packed binary ext values."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(frame: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    """Decode one frame with bounded sizes; raises CodecError on anything malformed or too large."""
    size = len(frame)
    if size > max_bytes:
        raise CodecError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            frame,
            ext_hook=_ext_hook,
            raw=False,
            strict_map_key=False,
            max_str_len=min(size, 64 << 20),
            max_bin_len=size,
            max_array_len=min(size, 16 << 20),
            max_map_len=min(size, 1 << 20),
            max_ext_len=size,
        )
    except CodecError:
        raise
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise CodecError(f"malformed msgpack frame: {type(e).__name__}: {e}") from None
