"""Exercise 08, a sharded optimizer step (ZeRO-1): ``my_slice`` and ``sharded_step``.

The reference is one process's AdamW on the whole batch (:func:`single_process_adamw`);
the calls are the rank's record: a reduce-scatter and an all-gather, never an allreduce;
the optimizer's state is counted on each rank: its slice's, no more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pcourse.tools.grading.checks import (
    NOT_YET,
    Check,
    Contract,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
    tensors_differ,
    uses,
)
from pcourse.tools.grading.refs.common import loss_of, make_data, make_model, shard_of
from pcourse.tools.grading.trials import CountingComm, check_left_behind, reports_calls, world

SLICE, STEP = Learner("my_slice"), Learner("sharded_step")


ZERO_LR, ZERO_DECAY = 0.05, 0.1  # AdamW; weight decay on, so a wrong slice of it shows


def zero_model() -> torch.nn.Module:
    """The gradient exercises' MLP in float64: 50 parameters, which 3 ranks do not divide."""
    return make_model().double()


def slice_trial(my_slice: Callable, ns: list[int]) -> list[tuple[int, ...]]:
    """This rank's ``my_slice(n, rank, size)`` for every n, as plain integers."""
    comm = world()
    return [tuple(int(v) for v in my_slice(n, comm.rank, comm.size)) for n in ns]


@reports_calls
def zero_trial(my_slice: Callable, sharded_step: Callable, steps: int) -> dict:
    """ZeRO on this rank: its slice (the learner's ``my_slice``), AdamW on it, ``steps``
    steps of the learner's ``sharded_step``; the flat parameters after each step.

    The flat parameters and gradient are padded with zeros to the length ``my_slice``
    says; this rank's AdamW steps only its slice, a copy of it (its master weights).
    """
    comm = world()
    # A process's first optimizer step imports torch's compiler, seconds on a busy
    # machine: paid here, then met at a barrier with room for it, so that no rank
    # waits for a slow peer inside the learner's first collective (5 s deadline).
    warm = torch.zeros(1, requires_grad=True)
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm]).step()
    sync = CountingComm(comm, timeout=120.0)
    sync.Barrier()
    model = zero_model()
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    n = sum(p.numel() for p in model.parameters())
    start, stop, padded = my_slice(n, comm.rank, comm.size)
    flat = torch.zeros(padded, dtype=torch.float64)
    flat[:n] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    shard = flat[start:stop].clone()
    opt = torch.optim.AdamW([shard], lr=ZERO_LR, weight_decay=ZERO_DECAY)
    out: dict = {"sync": sync.calls, "flat": [], "calls": [], "state": []}
    for _ in range(steps):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat[:n].clone(), model.parameters())
        model.zero_grad()
        loss_of(model, x, y).backward()
        grad = torch.zeros(padded, dtype=torch.float64)
        grad[:n] = torch.cat([p.grad.reshape(-1) for p in model.parameters()
                              if p.grad is not None])  # every one has one after backward
        counting = CountingComm(comm)
        sharded_step(flat, grad, shard, opt, counting)
        check_left_behind(counting, getattr(sharded_step, "__name__", "sharded_step"))
        out["flat"].append(flat[:n].clone())
        out["calls"].append(counting.calls)
        out["state"].append(sum(v.numel() for st in opt.state.values() for v in st.values()
                                if isinstance(v, torch.Tensor) and v.dim() > 0))
    return out


def single_process_adamw(steps: int) -> list[torch.Tensor]:
    """One process, the whole batch, torch's AdamW: the flat parameters after each step."""
    model = zero_model()
    x, y = (t.double() for t in make_data())
    opt = torch.optim.AdamW(model.parameters(), lr=ZERO_LR, weight_decay=ZERO_DECAY)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        out.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    return out


def slice_reference(n: int, size: int) -> list[tuple[int, int, int]]:
    """Every rank's (start, stop, padded): equal slices of n padded to a multiple of size."""
    per = -(-n // size)
    return [(r * per, (r + 1) * per, per * size) for r in range(size)]


def _slices(mc: Any, p: int) -> str | None:
    ns = [50, 7, 3, 2, 1, 12]
    got = run(mc, slice_trial, SLICE, ns, ranks=p)
    for k, n in enumerate(ns):
        mine, want = [o[k] for o in got], slice_reference(n, p)
        if mine != want:
            return (f"n={n}: slices {mine}, expected {want} (equal slices; padded to a multiple "
                    f"of {p})")
    return None


def _one_step(mc: Any, p: int) -> str | None:
    first = single_process_adamw(steps=1)
    got = run(mc, zero_trial, SLICE, STEP, steps=1, ranks=p)

    def test(r: int, out: dict) -> str | None:
        calls = out["calls"][0]
        return (tensors_differ(out["flat"], first, ["the parameters after one step"],
                               rtol=1e-10, atol=1e-12)
                or uses(calls, "Reduce_scatter_block", instead_of="Allreduce")
                or uses(calls, "Allgather"))

    return per_rank(got, test)


def _five_steps(mc: Any, p: int) -> str | None:
    five = single_process_adamw(steps=5)
    got = run(mc, zero_trial, SLICE, STEP, steps=5, ranks=p)

    def test(r: int, out: dict) -> str | None:
        size = slice_reference(50, p)[0][1]
        if out["state"][-1] != 2 * size:
            return (f"AdamW holds {out['state'][-1]} numbers of state, expected 2 x {size} "
                    "(its slice)")
        return tensors_differ(out["flat"], five, [f"the parameters after step {k + 1}"
                                                  for k in range(5)], rtol=1e-10, atol=1e-12)

    return per_rank(got, test)


CONTRACT = Contract(
    dtypes=(torch.float64,),
    shapes=((50,),),  # 50 parameters, which 3 ranks do not divide
    why_not={"dtypes": NOT_YET + " (float64 only)",
             "shapes": NOT_YET + " (one model of 50 parameters)",
             "aliasing": NOT_YET,
             "groups": NOT_YET + " (the world's communicator only)",
             "orders": "the functions take no order of actions",
             "accumulation": "sharded_step consumes the step's gradients, as an optimizer "
                             "step does"},
)

CHECKS = (
    Check("my_slice cuts n elements into equal slices of a padded vector",
          lambda mc: at_sizes(mc, lambda p: _slices(mc, p))),
    Check("one step equals one process's AdamW, by a reduce-scatter and an all-gather",
          lambda mc: at_sizes(mc, lambda p: _one_step(mc, p))),
    Check("5 steps equal one process's AdamW; the optimizer state is the slice's only",
          lambda mc: at_sizes(mc, lambda p: _five_steps(mc, p))),
)
check = checker(CHECKS)
