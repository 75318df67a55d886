"""A typed, versioned encoding of shard states (nested containers of numbers, strings and tensors).

What travels between a worker and a server must never be unpickled (``torch.load`` and pickle can run
code). A state is encoded as a JSON document describing its structure, followed by the raw bytes of its
tensors: ``b"IVYS"``, the format version (u32), the JSON length (u64), the JSON, the tensor bytes. Decoding
accepts only the container kinds, scalar types and tensor dtypes below and checks every size and offset,
so a malformed blob is a ``ValueError``, never code.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

MAGIC = b"IVYS"
VERSION = 1
_PREFIX = struct.Struct("<4sIQ")

#: dtypes a state may hold (names as JSON strings)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def encode(obj: Any) -> bytes:
    """``obj`` (dicts with str/int keys, lists, tuples, str, int, float, bool, None, paths, tensors, NumPy arrays
    and scalars of the dtypes below) as bytes."""
    blobs: list[bytes] = []
    offset = 0

    def walk(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_, np.void, np.object_)):
            array = np.asarray(x)  # before float: NumPy's float64 is a Python float too, and reads back as NumPy's
            if array.dtype.name not in DTYPES or array.dtype.name == "bfloat16":  # as decode reads them
                raise ValueError(f"cannot encode a NumPy {array.dtype} scalar; allowed: {sorted(DTYPES)}")
            return {"g": [array.dtype.name, x.item()]}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return {"i": str(x)}  # exact at any size (JSON readers may round big integers)
        if isinstance(x, float):
            return {"f": repr(x)} if not math.isfinite(x) else x
        if isinstance(x, PurePath):  # read back as a pathlib.Path
            return {"p": str(x)}
        if isinstance(x, np.ndarray):
            if x.dtype.name not in DTYPES or x.dtype.name == "bfloat16":
                raise ValueError(f"cannot encode a NumPy array of dtype {x.dtype}; allowed: {sorted(DTYPES)}")
            return {"N": walk(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, torch.Tensor):
            if x.dtype not in _NAMES:
                raise ValueError(f"cannot encode a tensor of dtype {x.dtype}; allowed: {sorted(DTYPES)}")
            data = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            entry = {"T": [_NAMES[x.dtype], list(x.shape), offset, len(data)]}
            blobs.append(data)
            offset += len(data)
            return entry
        if isinstance(x, dict):
            return {"d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return {"l": [walk(v) for v in x]}
        if isinstance(x, tuple):
            return {"t": [walk(v) for v in x]}
        raise ValueError(f"cannot encode a {type(x).__name__} in a PS state")

    doc = json.dumps(walk(obj), separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(doc)) + doc + b"".join(blobs)


def decode(blob: bytes) -> Any:
    """Inverse of :func:`encode`; ``ValueError`` for anything it did not write."""
    if len(blob) < _PREFIX.size:
        raise ValueError(f"not a PS state: {len(blob)} bytes")
    magic, version, doc_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"not a PS state (magic {magic!r})")
    if version != VERSION:
        raise ValueError(f"PS state format {version}; this ivyplug reads format {VERSION}")
    start = _PREFIX.size + doc_len
    if start > len(blob):
        raise ValueError("truncated PS state")
    try:
        doc = json.loads(blob[_PREFIX.size : start])
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"malformed PS state: {exc}") from None
    data = memoryview(blob)[start:]

    def walk(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str, float)):
            return x
        if isinstance(x, int):  # written as {"i": ...}, but a plain one is harmless
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError(f"malformed PS state entry {str(x)[:80]}")
        ((kind, value),) = x.items()
        if kind == "i":
            return int(value)
        if kind == "f":
            return float(value)
        if kind == "g":
            name, item = value
            if name not in DTYPES or name == "bfloat16" or not isinstance(item, (bool, int, float)):
                raise ValueError(f"malformed PS state NumPy scalar {value!r}")
            return np.dtype(name).type(item)
        if kind == "N":
            array = walk(value)
            if not isinstance(array, torch.Tensor) or array.dtype == torch.bfloat16:
                raise ValueError(f"malformed PS state NumPy array {str(value)[:80]}")
            return array.numpy()
        if kind == "p":
            if not isinstance(value, str):
                raise ValueError(f"malformed PS state path {value!r}")
            return Path(value)
        if kind == "d":
            return {walk(k): walk(v) for k, v in value}
        if kind == "l":
            return [walk(v) for v in value]
        if kind == "t":
            return tuple(walk(v) for v in value)
        if kind == "T":
            name, shape, off, nbytes = value
            if name not in DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"malformed PS state tensor {value!r}")
            dtype = DTYPES[name]
            numel = math.prod(shape)
            if nbytes != numel * torch.empty(0, dtype=dtype).element_size() or off < 0 or off + nbytes > len(data):
                raise ValueError(f"PS state tensor {value!r} does not fit the {len(data)} data bytes")
            raw = torch.frombuffer(bytearray(data[off : off + nbytes]), dtype=torch.uint8) if nbytes else None
            t = raw.view(dtype) if raw is not None else torch.empty(0, dtype=dtype)
            return t.reshape(shape)
        raise ValueError(f"unknown PS state entry kind {kind!r}")

    try:
        return walk(doc)
    except (TypeError, KeyError, AttributeError, RecursionError, OverflowError) as exc:  # an unhashable key, ...
        raise ValueError(f"malformed PS state: {exc}") from None
