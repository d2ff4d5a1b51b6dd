"""msgpack encoding of wire frames, with packed binary arrays and bounded decoding.

A message is a list of ZeroMQ frames: `[kind (1 byte)] [header (msgpack)] [payload (msgpack)]`.
numpy arrays travel as msgpack ext type 1 (a dtype code byte followed by the raw little-endian bytes),
never as lists of Python numbers. Decoding is bounded: a frame larger than `MAX_FRAME_BYTES`, or one whose
strings, arrays or maps exceed the limits below, raises `CodecError`, as does any malformed input; the
caller counts it and drops it (or replies with an error), it never crashes a process. Never pickle.

A frame's size does not bound what decoding it costs: an empty array is one byte on the wire and a
64-byte Python list in memory, so a frame of nested empty arrays (or maps) would grow ~64 times as it
decodes. So each frame also has an object budget (`MAX_OBJECTS`): every array and map counts one, plus
one per element (two per map entry), and decoding stops with `CodecError` once the budget is spent. The
longest single array is bounded by the budget too (msgpack allocates an array's list before its elements
arrive), so a frame at most decodes to a few dozen MB whatever its size. Token ids and log-probs travel
as packed ext values, one object each, so real messages use a small part of it (a Groups message of 160
samples, ~3,000).
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
MAX_OBJECTS = 1 << 18
"""Objects one frame may decode to (arrays, maps and their elements): ~30 MB of Python objects at most."""

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


class _Budget:
    """The objects a frame may still decode to; msgpack's hooks spend it as each array and map completes."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.left = self.limit = limit

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise CodecError(f"the frame decodes to more than {self.limit} objects (arrays, maps and their elements)")

    def array(self, items: list) -> list:
        self.spend(1 + len(items))
        return items

    def map(self, pairs: list[tuple[Any, Any]]) -> dict:
        self.spend(1 + 2 * len(pairs))
        return dict(pairs)


def unpack_header(frame: bytes | memoryview) -> Any:
    """Decode a header frame (at most `MAX_HEADER_BYTES`) as `unpack` does, but without the object budget's
    Python hooks: every object takes at least one byte of the frame, so a header decodes to at most ~4 MB
    whatever it holds. The router decodes one per message it forwards."""
    size = len(frame)
    if size > MAX_HEADER_BYTES:
        raise CodecError(f"frame of {size} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            frame, ext_hook=_ext_hook, raw=False, strict_map_key=False, max_str_len=size, max_bin_len=size,
            max_array_len=size, max_map_len=size, max_ext_len=size,
        )  # fmt: skip
    except CodecError:
        raise
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise CodecError(f"malformed msgpack frame: {type(e).__name__}: {e}") from None


def unpack(frame: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES, max_objects: int = MAX_OBJECTS) -> Any:
    """Decode one frame with bounded sizes and at most `max_objects` objects (see the module's docstring);
    raises CodecError on anything malformed or too large."""
    size = len(frame)
    if size > max_bytes:
        raise CodecError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    budget = _Budget(max_objects)
    try:
        return msgpack.unpackb(
            frame,
            ext_hook=_ext_hook,
            list_hook=budget.array,
            object_pairs_hook=budget.map,
            raw=False,
            strict_map_key=False,
            max_str_len=min(size, 64 << 20),
            max_bin_len=size,
            max_array_len=min(size, max_objects),
            max_map_len=min(size, max_objects // 2),
            max_ext_len=size,
        )
    except CodecError:
        raise
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise CodecError(f"malformed msgpack frame: {type(e).__name__}: {e}") from None
