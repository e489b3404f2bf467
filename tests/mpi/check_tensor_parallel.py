"""Run under mpiexec: tensor parallelism equals one process, in float64.

    python -m mpi4py check_tensor_parallel.py [BACKEND]

For every tp that divides the world size (2, 3, 4 ...), the world is split into
groups of tp consecutive ranks (MPI's ``Split``); each group runs the parallel MLP,
attention and whole block, with and without sequence parallelism, and compares the
output, the input's gradient and every parameter's gradient (its rank's block of the
one-process gradient) with one process running the whole block on the same input.
Non-dividing sizes are refused with both numbers. Prints
"tensor parallel OK on N ranks" on rank 0.
"""

from __future__ import annotations

import sys

import torch
from harness import RANK, SIZE, WORLD, expect, raises, verdict

from pcourse.backends import make_backend
from pcourse.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelBlock,
    ParallelMLP,
    RowParallelLinear,
    f,
    g,
    sync_sequence_parallel_grads,
)
from pcourse.workloads.transformer import Block

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "mpi"
T, B, D, HEADS, HIDDEN = 12, 2, 24, 12, 48  # every tp in 1..4 and 6 divides these
torch.set_default_dtype(torch.float64)


def serial(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                 dict[str, torch.Tensor]]:
    """Output, input gradient and parameter gradients of one process, on a fixed loss."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = module(x)
    (out * weights_like(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def weights_like(out: torch.Tensor) -> torch.Tensor:
    """A fixed, position-dependent cotangent: a plain sum would hide transposed blocks."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(out.shape, generator=gen)


def slice_for(name: str, full: torch.Tensor, part: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """The block of the one-process gradient ``full`` that this rank's ``part`` holds."""
    if full.shape == part.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != part.shape[d])
    n = full.shape[dim] // tp
    return full.narrow(dim, r * n, n)


def compare(tag: str, module, parallel, x: torch.Tensor, group, sp: bool) -> None:
    out, gx, grads = serial(module, x)
    tp, r = group.size, group.rank
    xs = x.chunk(tp, dim=0)[r].clone() if sp else x.clone()
    xs.requires_grad_()
    got = parallel(xs)
    want_out = out.chunk(tp, dim=0)[r] if sp else out
    w = weights_like(out)
    (got * (w.chunk(tp, dim=0)[r] if sp else w)).sum().backward()
    if sp:
        sync_sequence_parallel_grads(parallel, group)
    want_gx = gx.chunk(tp, dim=0)[r] if sp else gx
    expect(torch.allclose(got, want_out, rtol=1e-12, atol=1e-12),
           f"{tag}: output differs from one process by {(got - want_out).abs().max():.3g}")
    expect(torch.allclose(xs.grad, want_gx, rtol=1e-12, atol=1e-12),
           f"{tag}: input gradient differs by {(xs.grad - want_gx).abs().max():.3g}")
    for name, p in parallel.named_parameters():
        want = slice_for(name, grads[name], p.grad, tp, r)
        expect(torch.allclose(p.grad, want, rtol=1e-12, atol=1e-12),
               f"{tag}: gradient of {name} differs by {(p.grad - want).abs().max():.3g}")


def check_tp(tp: int) -> None:
    sub = WORLD.Split(RANK // tp, RANK)
    group = make_backend(BACKEND, comm=sub)
    sub.Free()
    torch.manual_seed(1234)
    block = Block(D, HEADS, HIDDEN)
    x = torch.randn(T, B, D)  # the same on every rank: seeded alike
    for sp in (False, True):
        tag = f"tp={tp}{' +sp' if sp else ''}"
        compare(f"{tag} mlp", block.mlp, ParallelMLP(block.mlp, group, sp), x, group, sp)
        compare(f"{tag} attention", block.attn, ParallelAttention(block.attn, group, sp), x,
                group, sp)
        compare(f"{tag} block", block, ParallelBlock(block, group, sp), x, group, sp)
    if tp > 1:
        bad = torch.nn.Linear(D, tp * 3 + 1)
        expect(raises(ValueError, ColumnParallelLinear.from_linear, bad, group,
                      match=f"out_features ({tp * 3 + 1}) does not divide by the "
                            f"tensor-parallel size ({tp})"), f"tp={tp}: bad split not refused")
        expect(raises(ValueError, RowParallelLinear.from_linear,
                      torch.nn.Linear(tp * 3 + 1, D), group, match="in_features"),
               f"tp={tp}: bad row split not refused")
    # f and g are conjugate: f's backward is g's forward, and the other way round
    y = torch.full((3,), float(group.rank + 1), requires_grad=True)
    s = g(f(y, group), group)
    expect(torch.equal(s.detach(), torch.full((3,), float(tp * (tp + 1) // 2))),
           f"tp={tp}: g did not sum over the group")
    s.backward(torch.ones(3))
    expect(torch.equal(y.grad, torch.full((3,), float(tp))),
           f"tp={tp}: f's backward did not sum over the group")
    group.close()


for tp in (d for d in range(1, SIZE + 1) if SIZE % d == 0):
    check_tp(tp)

sys.exit(verdict(f"tensor parallel OK on {SIZE} ranks" + (f" ({BACKEND})"
                                                            if BACKEND != "mpi" else "")))
