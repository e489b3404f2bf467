"""Exercise 05, broadcast the weights and check consistency: ``broadcast_parameters`` and
``max_spread``.

The models are built here for every rank from the same seeds (the state before a
broadcast, the spread of the gathered tensors), never read back from the ranks: float64,
a weight stored transposed, a frozen parameter, BatchNorm's buffers with an integer one.
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
    once,
    per_rank,
    run,
    tensors_differ,
)
from pcourse.tools.grading.refs.common import addresses, params
from pcourse.tools.grading.trials import CountingComm, check_left_behind, reports_calls, world

BROADCAST, SPREAD = Learner("broadcast_parameters"), Learner("max_spread")
OTHER_ROOTS = {2: [1], 3: [2, 1], 4: [3, 2]}


def _bn_model(seed: int, shift: float = 0.0, forwards: int = 1) -> Any:  # a Sequential
    """Linear + BatchNorm; ``forwards`` train-mode passes on data shifted by ``shift``."""
    torch.manual_seed(seed)
    model: Any = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    # the contract's whole range: float64, a weight stored transposed (a copy of it is no
    # longer the model's memory), a frozen parameter (a broadcast covers it too)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())
    model[0].bias.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(forwards):
        model(torch.randn(16, 3, generator=gen, dtype=torch.float64) + shift)
    return model


def diverged_model(rank: int) -> Any:  # a Sequential
    """Weights, running statistics and batch counts that all differ from rank to rank."""
    return _bn_model(100 + rank, shift=rank, forwards=rank + 1)


def broadcast_source(root: int) -> list[torch.Tensor]:
    """What the root holds before (and after) a broadcast from ``root``, built here.

    Up to rounding: BatchNorm's statistics sum in another order on another number of
    threads; the ranks' tensors are compared bit for bit with the root's own."""
    return params(diverged_model(root))


# running_mean offsets per rank: rank 0 in the middle, so the spread (max - min over
# ranks) is larger than any rank's distance from rank 0; and at 4 ranks the extremes are
# ranks 1 and 3, which are no ring neighbours: comparing neighbours only misses them
BUFFER_SHIFTS = (0.0, 0.75, -0.5, -0.75)


def buffers_only_model(rank: int) -> Any:  # a Sequential
    """The same weights on every rank; only the running mean differs."""
    model = _bn_model(0)
    with torch.no_grad():
        model[1].running_mean += BUFFER_SHIFTS[rank % len(BUFFER_SHIFTS)]
    return model


def state_names() -> list[str]:
    return list(_bn_model(0).state_dict())


@reports_calls
def broadcast_trial(broadcast: Callable, roots: list[int]) -> list[dict]:
    """For each root: the state after ``broadcast(model, comm, root)``, in place or not (the
    checks know the state before: :func:`broadcast_source`)."""
    comm = world()
    out = []
    for root in roots:
        model = diverged_model(comm.rank)
        where = addresses(model)
        counting = CountingComm(comm)
        broadcast(model, counting, root)
        check_left_behind(counting, getattr(broadcast, "__name__", "the broadcast"))
        out.append({"root": root, "after": params(model),
                    "in_place": where == addresses(model), "calls": counting.calls})
    return out


def counts_only_model(rank: int) -> Any:  # a Sequential
    """The same floats on every rank; only the (integer) count of batches seen differs."""
    model = _bn_model(0)
    model[1].num_batches_tracked += rank
    return model


def nearly_identical_model(rank: int) -> Any:  # a Sequential
    """The same everywhere but one weight, 3e-9 apart between ranks 0 and 1: a spread that
    a rounded answer (to 6 decimals, or through float32) says is 0."""
    model = _bn_model(0)
    with torch.no_grad():
        model[0].weight[1, 2] += 3e-9 * (rank == 1)
    return model


SPREAD_MODELS: dict[str, Callable[[int], torch.nn.Module]] = {
    "diverged": diverged_model, "buffers only": buffers_only_model,
    "batch counts only": counts_only_model, "nearly identical": nearly_identical_model,
    "identical": lambda rank: _bn_model(0)}
SPREAD_CASES = tuple(SPREAD_MODELS)


def spread_trial(spread: Callable) -> dict:
    """The learner's ``spread(model, comm)`` of four models, and whether it left them alone."""
    comm = world()
    out = {}
    for case, make in SPREAD_MODELS.items():
        model = make(comm.rank)
        before, where = params(model), addresses(model)
        counting = CountingComm(comm)
        value = spread(model, counting)
        check_left_behind(counting, getattr(spread, "__name__", "max_spread"))
        after = params(model)
        untouched = where == addresses(model) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out[case] = {"value": float(value), "untouched": untouched}
    return out


def spread_reference(case: str, size: int) -> float:
    """Largest max-over-ranks minus min-over-ranks of any element of the ``case`` models,
    built here for every rank (never read from the ranks)."""
    states = [params(SPREAD_MODELS[case](rank)) for rank in range(size)]
    spread = 0.0
    for tensors in zip(*states, strict=True):
        stacked = torch.stack([t.double() for t in tensors])
        spread = max(spread, (stacked.max(0).values - stacked.min(0).values).max().item())
    return spread


def _broadcasts(mc: Any, p: int, roots: list[int]) -> str | None:
    got = run(mc, broadcast_trial, BROADCAST, roots, ranks=p)
    for k, root in enumerate(roots):
        source = got[root][k]["after"]  # the root's, which must hold what it held before
        problem = tensors_differ(source, broadcast_source(root), state_names(),
                                 rtol=1e-12, atol=1e-12)  # built here: threads round apart
        if problem:
            return f"from root {root}, the root's own {problem}: a broadcast leaves it as it was"
        for r, o in enumerate(got):
            problem = tensors_differ(o[k]["after"], source, state_names(), rtol=0, atol=0) or (
                None if o[k]["in_place"] else
                "a tensor was replaced by a new one; broadcast into the model's own memory")
            if problem:
                return f"from root {root}, rank {r}: {problem}"
    return None


def _spread_run(mc: Any, p: int) -> list[dict]:
    """The learner's max_spread at p ranks, run once for the two checks that read it."""
    return once(mc, ("spread", p, SPREAD), lambda: run(mc, spread_trial, SPREAD, ranks=p))


def _spreads(mc: Any, p: int) -> str | None:
    got = _spread_run(mc, p)
    for case in SPREAD_CASES:
        want = spread_reference(case, p)
        for r, o in enumerate(got):
            if abs(o[case]["value"] - want) > 1e-9 * want:
                return (f"rank {r}: max_spread gave {o[case]['value']:.6g} for {case} models; "
                        f"their tensors differ by up to {want:.6g}")
    return None


def _untouched(mc: Any, p: int) -> str | None:
    got = _spread_run(mc, p)
    return per_rank(got, lambda r, o: next((f"max_spread changed the {case} model: reduce "
                                            "copies, never the model's own tensors"
                                            for case in SPREAD_CASES
                                            if not o[case]["untouched"]), None))


CONTRACT = Contract(
    dtypes=(torch.float64, torch.int64),  # parameters, and BatchNorm's integer buffer
    layouts=("a weight stored transposed",),
    aliasing=("the model's tensors: the same after a broadcast (in place); max_spread "
              "leaves the model untouched",),
    why_not={"dtypes": NOT_YET + " (float64 and an integer buffer; no float32 model)",
             "shapes": NOT_YET + " (one model, its parameters all different in shape)",
             "groups": NOT_YET + " (the world's communicator only)",
             "orders": "the functions take no order of actions",
             "accumulation": "the functions read and write weights, no gradients"},
)

CHECKS = (
    Check("after a broadcast from rank 0 every rank holds rank 0's parameters and buffers",
          lambda mc: at_sizes(mc, lambda p: _broadcasts(mc, p, [0]))),
    Check("a broadcast from any other root gives everyone that root's tensors",
          lambda mc: at_sizes(mc, lambda p: _broadcasts(mc, p, OTHER_ROOTS[p]))),
    Check("max_spread equals the spread of the gathered parameters and buffers",
          lambda mc: at_sizes(mc, lambda p: _spreads(mc, p))),
    Check("max_spread leaves the model untouched",
          lambda mc: at_sizes(mc, lambda p: _untouched(mc, p))),
)
check = checker(CHECKS)
