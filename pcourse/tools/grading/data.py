"""What comes back from learner code, read as data only: numbers, strings, arrays, tensors.

A result of learner code may be a pickle that would run code when rebuilt. The kernel
that decides a grade (:mod:`.harness`) and an engine that makes a learner process's MPI
calls (:mod:`.relay`) rebuild only plain data from it (:func:`safe_loads`); anything
else arrives as a :class:`Refused`, of which nothing runs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


class Refused:
    """What arrives in place of an object the grader does not rebuild (nothing of it runs)."""

    what = "something"

    def __new__(cls, *args: Any, **kwargs: Any) -> Refused:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<refused {self.what}>"


def _refused(what: str) -> type:
    return type("Refused", (Refused,), {"what": what})


_DATA = {("builtins", n) for n in ("list", "dict", "set", "frozenset", "tuple", "complex",
                                   "int", "float", "bool", "bytes", "bytearray", "str",
                                   "slice", "range", "object")}
_DATA |= {("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
          ("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2"),
          ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_parameter"),
          ("pcourse.tools.grading.trials", "Call")}
_DATA |= {(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray")
          for n in ("_reconstruct", "scalar")}
_DATA |= {("numpy", "ndarray"), ("numpy", "dtype")}
_DATA |= {("pcourse.tools.grading.relay", n) for n in ("Mpi", "Ref", "Made", "Obj")}
_DATA |= {(m, n) for m in ("ipyparallel.serialize.canning", "ipyparallel.serialize")
          for n in ("CannedArray", "CannedBytes", "CannedMemoryView", "CannedObject")}


def _storage_from_bytes(data: bytes) -> Any:
    """torch's storages travel as torch.save bytes: read them with torch's safe loader."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DATA or module.startswith("numpy.dtypes"):
            return super().find_class(module, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _refused(f"{module}.{name}")


def safe_loads(data: Any) -> Any:
    """Unpickle ``data`` rebuilding only plain data; every other object becomes a Refused."""
    return _DataUnpickler(io.BytesIO(data)).load()


def refusals(value: Any, depth: int = 0) -> str | None:
    """The first Refused in a result (nested in lists, tuples and dicts), if any."""
    if isinstance(value, Refused) or (isinstance(value, type) and issubclass(value, Refused)):
        return value.what  # an object, or a class named by reference
    if depth < 8 and isinstance(value, list | tuple | set | frozenset):
        return next((r for r in (refusals(v, depth + 1) for v in value) if r), None)
    if depth < 8 and isinstance(value, dict):
        return next((r for r in (refusals(v, depth + 1)
                                 for v in [*value.keys(), *value.values()]) if r), None)
    return None
