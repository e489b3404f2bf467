"""Plain data across the grader's trust boundaries: a format that cannot carry code.

Everything a less trusted process hands a more trusted one (a learner process to its
rank, a rank to the grader) travels as these bytes, never as a pickle. A pickle is a
program: rebuilding one calls whatever functions it names, and an allowlist of names is
only as good as the unpickler's every way of looking one up (protocol 4 walks dotted
names: ``numpy.dtypes.__builtins__.get("exec")`` is ``exec``). Here the reader looks
nothing up by a name the bytes give: each value starts with one tag byte from a fixed
table, and the only types it builds are

- ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``;
- ``list``, ``tuple``, ``dict``;
- numpy arrays and torch tensors of a fixed list of numeric dtypes (:data:`DTYPES`),
  rebuilt from their raw bytes, dtype and shape (never numpy's object arrays);
- the grader's own records (:data:`RECORDS`): plain named tuples of the above.

:func:`loads` refuses anything else, bytes left over, nesting deeper than
:data:`MAX_DEPTH`, and counts or shapes larger than the bytes that carry them (so a
forged count cannot make it allocate), always with :class:`WireError`, whose message says
what was wrong. :func:`dumps` refuses what it cannot write with a TypeError that names it.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"PCW1"
MAX_DEPTH = 64  # nesting of lists, tuples, dicts and records
MAX_NDIM = 32  # numpy's own limit
MAX_INT_BYTES = 64  # a Python int of up to 512 bits


class WireError(ValueError):
    """Bytes that are not a value of this format (what was wrong, and where)."""


# ---------------------------------------------------------------- the grader's records

class Call(NamedTuple):
    """One communicator call, as a check sees it (made and recorded by a rank)."""

    name: str  # the method called, e.g. "Sendrecv"
    # numbers in the buffer it sent (or received, for a receive). The field shadows
    # tuple.count, which no record uses; mypy cannot tell a field from the method it hides.
    count: int  # type: ignore[assignment]
    peer: int | None  # dest of a send, source of a receive, root of a rooted collective


class Learner(NamedTuple):
    """A name a learner's cells bind, passed to a trial: the learner's object of that name,
    looked up where their code runs (never in the process that grades)."""

    name: str


def resolve(value: Any, namespace: dict) -> Any:
    """``value`` with every :class:`Learner` record replaced by ``namespace``'s object of
    that name (a NameError that names it, where there is none), through lists, tuples and
    dicts: where the learner's code runs, never where it is graded."""
    if isinstance(value, Learner):
        if value.name not in namespace:
            raise NameError(f"name {value.name!r} is not defined")
        return namespace[value.name]
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(resolve(v, namespace) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, namespace) for k, v in value.items()}
    return value


class Mpi(NamedTuple):
    """One of MPI's named constants: an op, a datatype, ``IN_PLACE``, ``COMM_NULL``."""

    name: str


class Ref(NamedTuple):
    """An object a rank holds for its learner process: a communicator or a request."""

    id: int


class Made(NamedTuple):
    """A communicator a rank made for its learner process, and the process's place in it."""

    id: int
    rank: int
    size: int


class Obj(NamedTuple):
    """The object of a lowercase (pickle-based) MPI call: plain data, carried as it is."""

    value: Any


RECORDS: tuple[type, ...] = (Call, Learner, Mpi, Ref, Made, Obj)
_RECORD_CODE = {cls: k for k, cls in enumerate(RECORDS)}

DTYPES: tuple[str, ...] = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
                           "uint32", "uint64", "float16", "bfloat16", "float32", "float64",
                           "complex64", "complex128")
_NUMPY = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}


def _torch() -> Any:
    """torch, imported only where a tensor is read (a process that never imported torch
    holds no tensor to write): a rank that only relays numbers never pays for it."""
    import torch

    return torch

_NONE, _TRUE, _FALSE, _INT, _BIGINT, _FLOAT, _COMPLEX = b"NTFiIfc"
_STR, _BYTES, _LIST, _TUPLE, _DICT, _ARRAY, _TENSOR, _RECORD = b"sbltdaxr"


# ---------------------------------------------------------------- writing

def dumps(value: Any) -> bytes:
    """``value`` as bytes of this format; TypeError naming what cannot be written."""
    out = [MAGIC]
    _write(value, out, 0)
    return b"".join(out)


def _write(v: Any, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"nested more than {MAX_DEPTH} deep")
    code = _RECORD_CODE.get(type(v))
    if code is not None:
        out.append(struct.pack("<BBB", _RECORD, code, len(v)))
        for field in v:
            _write(field, out, depth + 1)
    elif v is None or isinstance(v, bool | np.bool_):
        out.append(bytes([_NONE if v is None else _TRUE if v else _FALSE]))
    elif isinstance(v, int | np.integer):
        _write_int(int(v), out)
    elif isinstance(v, float | np.floating):
        out.append(struct.pack("<Bd", _FLOAT, float(v)))
    elif isinstance(v, complex | np.complexfloating):
        out.append(struct.pack("<Bdd", _COMPLEX, v.real, v.imag))
    elif isinstance(v, str):
        data = v.encode("utf-8", "surrogatepass")
        out.append(struct.pack("<BQ", _STR, len(data)) + data)
    elif isinstance(v, bytes | bytearray | memoryview):
        data = bytes(v)
        out.append(struct.pack("<BQ", _BYTES, len(data)) + data)
    elif isinstance(v, list | tuple):
        out.append(struct.pack("<BQ", _LIST if isinstance(v, list) else _TUPLE, len(v)))
        for item in v:
            _write(item, out, depth + 1)
    elif isinstance(v, dict):
        out.append(struct.pack("<BQ", _DICT, len(v)))
        for key, item in v.items():
            _write(key, out, depth + 1)
            _write(item, out, depth + 1)
    elif isinstance(v, np.ndarray):
        _write_array(v, out)
    elif "torch" in sys.modules and isinstance(v, sys.modules["torch"].Tensor):
        _write_tensor(v, out)
    else:
        raise TypeError(f"a {type(v).__module__}.{type(v).__qualname__} is not plain data "
                        "(numbers, strings, lists, tuples, dicts, arrays, tensors)")


def _write_int(n: int, out: list) -> None:
    if -(1 << 63) <= n < (1 << 63):
        out.append(struct.pack("<Bq", _INT, n))
        return
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    if len(data) > MAX_INT_BYTES:
        raise TypeError(f"an int of {n.bit_length()} bits: at most {8 * MAX_INT_BYTES - 1}")
    out.append(struct.pack("<BB", _BIGINT, len(data)) + data)


def _shape(shape: tuple[int, ...]) -> bytes:
    return struct.pack(f"<B{len(shape)}Q", len(shape), *shape)


def _write_array(a: np.ndarray, out: list) -> None:
    name = a.dtype.name
    if name not in _NUMPY or a.dtype.hasobject:
        raise TypeError(f"an array of dtype {a.dtype} is not numeric data: use one of "
                        f"{', '.join(n for n in DTYPES if n in _NUMPY)}")
    data = np.ascontiguousarray(a, dtype=_NUMPY[name]).tobytes()
    out.append(struct.pack("<BB", _ARRAY, DTYPES.index(name)) + _shape(a.shape)
               + struct.pack("<Q", len(data)) + data)


def _write_tensor(t: Any, out: list) -> None:
    torch = _torch()
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES or t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"a tensor of dtype {t.dtype} (or layout {t.layout}) is not dense "
                        "numeric data")
    flat = t.detach().to("cpu").contiguous()
    raw = flat.view(torch.int16) if name == "bfloat16" else flat
    data = raw.numpy().tobytes() if raw.numel() else b""
    out.append(struct.pack("<BB", _TENSOR, DTYPES.index(name)) + _shape(tuple(t.shape))
               + struct.pack("<Q", len(data)) + data)


# ---------------------------------------------------------------- reading

class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise WireError(f"{n} bytes wanted at offset {self.at}, "
                            f"{len(self.data) - self.at} left: the data ends too soon")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def count(self, smallest: int = 1) -> int:
        """A count of items, each at least ``smallest`` bytes: never more than are left."""
        (n,) = self.unpack("<Q")
        if n * smallest > len(self.data) - self.at:
            raise WireError(f"a count of {n} at offset {self.at} is more than the "
                            f"{len(self.data) - self.at} bytes left could hold")
        return n


def loads(data: bytes) -> Any:
    """The value in ``data`` (made by :func:`dumps`); WireError saying why where it is not one."""
    try:
        reader = _Reader(bytes(memoryview(data)))
    except TypeError:
        raise WireError(f"expected bytes, got {type(data).__name__}") from None
    if bytes(reader.take(len(MAGIC))) != MAGIC:
        raise WireError("not data of this format (no PCW1 header): a pickle, or garbled")
    try:
        value = _read(reader, 0)
    except WireError:
        raise
    except (struct.error, ValueError, TypeError, OverflowError, MemoryError) as exc:
        raise WireError(f"unreadable at offset {reader.at}: {type(exc).__name__}: {exc}") \
            from None
    if reader.at != len(reader.data):
        raise WireError(f"{len(reader.data) - reader.at} bytes left over after the value")
    return value


def _read(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"nested more than {MAX_DEPTH} deep")
    (tag,) = r.take(1)
    if tag in (_NONE, _TRUE, _FALSE):
        return None if tag == _NONE else tag == _TRUE
    if tag == _INT:
        return r.unpack("<q")[0]
    if tag == _BIGINT:
        (n,) = r.unpack("<B")
        if not 0 < n <= MAX_INT_BYTES:
            raise WireError(f"an int of {n} bytes")
        return int.from_bytes(r.take(n), "little", signed=True)
    if tag == _FLOAT:
        return r.unpack("<d")[0]
    if tag == _COMPLEX:
        return complex(*r.unpack("<dd"))
    if tag == _STR:
        try:
            return bytes(r.take(r.count())).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise WireError(f"a string that is not UTF-8: {exc}") from None
    if tag == _BYTES:
        return bytes(r.take(r.count()))
    if tag in (_LIST, _TUPLE):
        items = [_read(r, depth + 1) for _ in range(r.count())]
        return items if tag == _LIST else tuple(items)
    if tag == _DICT:
        return _read_dict(r, depth)
    if tag in (_ARRAY, _TENSOR):
        return _read_array(r, tensor=tag == _TENSOR)
    if tag == _RECORD:
        return _read_record(r, depth)
    raise WireError(f"unknown tag {tag!r} at offset {r.at - 1}")


def _read_dict(r: _Reader, depth: int) -> dict:
    found: dict = {}
    for _ in range(r.count(smallest=2)):
        key = _read(r, depth + 1)
        try:
            found[key] = _read(r, depth + 1)
        except TypeError:
            raise WireError(f"a dict key of type {type(key).__name__} (not hashable)") from None
    return found


def _read_record(r: _Reader, depth: int) -> tuple:
    code, n = r.unpack("<BB")
    if code >= len(RECORDS):
        raise WireError(f"unknown record {code}")
    cls = RECORDS[code]
    if n != len(cls._fields):
        raise WireError(f"a {cls.__name__} of {n} fields; it has {len(cls._fields)}")
    return cls(*(_read(r, depth + 1) for _ in range(n)))


def _read_array(r: _Reader, tensor: bool) -> Any:
    code, ndim = r.unpack("<BB")
    if code >= len(DTYPES) or ndim > MAX_NDIM:
        raise WireError(f"an array of dtype code {code} and {ndim} dimensions")
    name = DTYPES[code]
    shape = r.unpack(f"<{ndim}Q")
    itemsize = 2 if name == "bfloat16" else _NUMPY[name].itemsize
    (nbytes,) = r.unpack("<Q")
    if nbytes != math.prod(shape) * itemsize:
        raise WireError(f"an array of shape {shape} and dtype {name} in {nbytes} bytes")
    raw = r.take(nbytes)
    if name == "bfloat16":
        if not tensor:
            raise WireError("a numpy array of bfloat16 (numpy has none)")
        torch = _torch()
        return torch.from_numpy(_array(raw, np.dtype("int16"), shape)).view(torch.bfloat16)
    array = _array(raw, _NUMPY[name], shape)
    return _torch().from_numpy(array) if tensor else array


def _array(raw: memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A writable array of its own (a trial may write into what it was given)."""
    array = np.empty(shape, dtype=dtype)
    if array.size:
        array.reshape(-1)[:] = np.frombuffer(raw, dtype=dtype)
    return array
