"""What one rank computes in a step, counted operator by operator, and priced (lesson 13).

Every tensor operation a forward, a backward or an optimizer runs reaches torch's
dispatcher as one ATen operator. :func:`count_ops` watches them go by
(``TorchDispatchMode``) and writes down, for each, its floating-point operations (torch's
own table, :data:`torch.utils.flop_counter.flop_registry`: matrix products and attention)
and the bytes of the tensors it reads and writes. Views (a reshape, a transpose) move
nothing and are left out. It also writes down through how many other Python dispatch
modes the operator passed on its way (torch's selective checkpointing puts one in front
of every operator it watches: Python code run per operator).

:func:`compute_time` prices the list on a measured :class:`~pcourse.cost_model.machine.Machine`,
a roofline with a floor: each operator costs its fixed overhead, plus either its FLOPs at
the rate the machine reached on a product (or an attention) of that size, or its bytes at
the machine's streaming bandwidth, whichever is longer; the few operators that compute
more per element than they move (GELU, the norms) at their own measured cost per byte;
and the new memory a result fills is touched for the first time, at a measured cost per
byte (the kernel hands out pages as they are first written); and each Python dispatch
mode it passed through, the overhead measured per operator for one. Views move nothing
and cost their dispatch. Small operators are all overhead; large products are all FLOPs;
additions are all bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from pcourse.cost_model.machine import Machine


@dataclass(frozen=True)
class Op:
    """One operator as it ran: its name, FLOPs (0 where it does no arithmetic worth
    counting), the bytes of its tensor arguments and results, the bytes of the results
    it wrote to new memory (``fresh``), and whether it is a view (no bytes move) and of
    how many tensors."""

    name: str
    flops: int
    bytes: int
    fresh: int = 0
    view: bool = False
    tensors: int = 1  # a view's results: a split makes many
    modes: int = 0  # Python dispatch modes it passed through before this count's


@dataclass
class Counts:
    """The operators of one piece of work, in the order they ran."""

    ops: list[Op] = field(default_factory=list)

    @property
    def operators(self) -> int:
        """Operators that are not views."""
        return sum(not op.view for op in self.ops)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def bytes(self) -> int:
        return sum(op.bytes for op in self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.ops + other.ops)


def _tensor_bytes(values: Any) -> int:
    flat, _ = tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _fresh_bytes(args: Any, kwargs: Any, out: Any) -> int:
    """Bytes of the results that are new memory (not an argument written in place)."""
    given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
             if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given)


class _Recorder(TorchDispatchMode):
    """Runs every operator as usual and appends what it did to ``counts``."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        modes = _modes_above()
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or func in _FREE:
            made = sum(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
            self.counts.ops.append(Op(packet.__name__, 0, 0, view=True, tensors=made,
                                      modes=modes))
            return out
        self.counts.ops.append(Op(packet.__name__, int(flops_of(packet, args, kwargs, out)),
                                  _tensor_bytes((args, kwargs)) + _tensor_bytes(out),
                                  _fresh_bytes(args, kwargs, out), modes=modes))
        return out


def _modes_above() -> int:
    """How many other Python dispatch modes handed this operator on to the recorder: the
    ``__torch_dispatch__`` frames below the recorder's own on Python's stack (a mode
    pushed after the recorder handles an operator first, then calls it again)."""
    frame: Any = sys._getframe(2)  # 0: this function, 1: the recorder's handler
    modes = 0
    while frame is not None:
        modes += frame.f_code.co_name == "__torch_dispatch__"
        frame = frame.f_back
    return modes


_FREE = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
         torch.ops.aten._unsafe_view.default}  # a view by another name: nothing moves
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flops_of(packet: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """An operator's FLOPs by torch's table; CPU attention (not in the table) by the
    formulas torch's table uses for the same attention elsewhere (4·b·h·s·s·d forward)."""
    if packet is _CPU_ATTENTION:
        return sdpa_flop_count(*(t.shape for t in args[:3]))
    if packet is _CPU_ATTENTION_BACKWARD:
        return sdpa_backward_flop_count(*(t.shape for t in args[:4]))
    if packet in flop_registry:
        return flop_registry[packet](*args, **kwargs, out_val=out)
    return 0


def count_ops(fn: Callable[[], Any]) -> tuple[Counts, Any]:
    """Run ``fn()`` and count the operators it dispatched; (the counts, its result).

    The work is really done (the counts are of what ran, on these tensors): count a
    copy of a model, or a step whose result you keep.
    """
    counts = Counts()
    with _Recorder(counts):
        result = fn()
    return counts, result


def op_time(op: Op, machine: Machine) -> float:
    """Seconds of one operator on one core: a view costs its dispatch only; any other,
    its overhead, the longer of its FLOPs at the rate measured for its kind and size
    (attention's own, or a product's) and its bytes at the streaming bandwidth (or the
    per-byte cost measured for it by name), and the first touch of the new memory its
    results fill; and per Python dispatch mode it passed through, the overhead measured
    for one."""
    modes = op.modes * machine.mode_overhead
    if op.view:
        return machine.view_overhead * op.tensors + modes
    kind = "attention" if "scaled_dot_product" in op.name else "matmul"
    arithmetic = op.flops / machine.rate(op.flops, kind) if op.flops else 0.0
    per_byte = machine.per_byte.get(op.name, 1 / machine.bandwidth)
    return (machine.op_overhead + max(arithmetic, op.bytes * per_byte)
            + op.fresh * machine.first_touch + modes)


def compute_time(counts: Counts, machine: Machine, ranks: int = 1) -> float:
    """Seconds of ``counts`` on one rank while ``ranks`` ranks compute on the machine
    (sharing its cores: :meth:`~pcourse.cost_model.machine.Machine.share`)."""
    return sum(op_time(op, machine) for op in counts.ops) / machine.share(ranks)
