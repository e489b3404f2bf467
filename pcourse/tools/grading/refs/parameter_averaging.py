"""Exercise 07, periodic parameter averaging: ``average_parameters`` and ``local_sgd``.

The references are built here: the mean of every rank's weights (:func:`mean_parameters`),
one process on the whole batch for period 1 (synchronous SGD), and a serial simulation of
every rank for a longer period (:func:`local_sgd_reference`).
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
)
from pcourse.tools.grading.refs.common import (
    addresses,
    differ,
    learner_call,
    loss_of,
    make_data,
    make_model,
    names,
    params,
    sgd_step,
    shard_of,
    single_process_sgd,
)
from pcourse.tools.grading.trials import CountingComm, check_left_behind, world

AVERAGE, LOCAL_SGD = Learner("average_parameters"), Learner("local_sgd")


def average_params_trial(average: Callable) -> dict:
    """Rank-dependent weights after the learner's ``average(model, comm)``.

    The general model (:func:`make_model`), with an integer buffer that differs between
    ranks (a count of steps, as BatchNorm's ``num_batches_tracked``): parameters are
    averaged, buffers are not (torch's own parameter averaging takes ``parameters()``;
    an integer has no average). ``after``: the parameters only; the checks build the
    weights before itself (:func:`mean_parameters`).
    """
    comm = world()
    model = _averaged_model(comm.rank)
    where, buffers = addresses(model), [b.clone() for b in model.buffers()]
    learner_call(average, CountingComm(comm), model)
    return {"after": [t.detach().clone() for t in model.parameters()],
            "in_place": where == addresses(model),
            "buffers_kept": all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(),
                                                                  strict=True))}


def _averaged_model(rank: int) -> torch.nn.Module:
    model = make_model(seed=10 + rank, general=True)
    model.register_buffer("steps_seen", torch.tensor(7 + rank))
    return model


def mean_parameters(size: int) -> list[torch.Tensor]:
    """The mean over ``size`` ranks of :func:`average_params_trial`'s weights, built here."""
    models = [_averaged_model(rank) for rank in range(size)]
    weights = [[t.detach() for t in m.parameters()] for m in models]
    return [sum(ts) / size for ts in zip(*weights, strict=True)]


def local_sgd_trial(local_sgd: Callable, steps: int, period: int, lr: float = 0.1) -> list:
    """Final parameters after the learner's ``local_sgd`` on this rank's shard."""
    comm = world()
    model = make_model(general=True)
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    counting = CountingComm(comm)
    local_sgd(model, x, y, counting, steps=steps, period=period, lr=lr)
    check_left_behind(counting, getattr(local_sgd, "__name__", "local_sgd"))
    return params(model)


def local_sgd_reference(size: int, steps: int, period: int, lr: float = 0.1) -> list:
    """Every rank's final parameters, simulated serially in one process.

    Each simulated rank takes plain SGD steps on its shard; after step k·period the
    parameters of all of them are replaced by their mean.
    """
    models = [make_model(general=True) for _ in range(size)]
    shards = [tuple(t.double() for t in shard_of(make_data(), r, size)) for r in range(size)]
    for step in range(1, steps + 1):
        for model, (x, y) in zip(models, shards, strict=True):
            model.zero_grad()
            loss_of(model, x, y).backward()
            sgd_step(model, lr)
        if step % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [params(m) for m in models]


def _averaged(mc: Any, p: int) -> str | None:
    got = run(mc, average_params_trial, AVERAGE, ranks=p)
    mean = mean_parameters(p)
    return per_rank(got, lambda r, o: differ(o["after"], mean, names()) or (
        None if o["in_place"] else "a parameter was replaced by a new tensor; average in place"
    ) or (None if o["buffers_kept"] else "a buffer changed: average the parameters only "
          "(model.parameters()); an integer buffer has no average"))


def _synchronous(mc: Any, p: int) -> str | None:
    want = single_process_sgd(steps=5)["params"]  # one process, the whole batch
    got = run(mc, local_sgd_trial, LOCAL_SGD, steps=5, period=1, ranks=p)
    return per_rank(got, lambda r, mine: differ(mine, want, names()))


def _periodic(mc: Any, p: int) -> str | None:
    got = run(mc, local_sgd_trial, LOCAL_SGD, steps=10, period=4, ranks=p)
    want = local_sgd_reference(p, steps=10, period=4)  # every rank, simulated here
    return per_rank(got, lambda r, mine: differ(mine, want[r], names()))


CONTRACT = Contract(
    dtypes=(torch.float64,),
    aliasing=("the parameters: averaged in place, the same tensors after",),
    why_not={"dtypes": NOT_YET + " (the general model's float64)",
             "shapes": NOT_YET + " (one model)",
             "groups": NOT_YET + " (the world's communicator only; federated averaging over "
                                 "subsets is lesson 08's, not this exercise's)",
             "orders": "the functions take no order of actions (a period, tried at 1 and 4)",
             "accumulation": "local_sgd zeroes its own gradients each step, as SGD does"},
)

CHECKS = (
    Check("average_parameters gives every rank the mean of the ranks' weights, in place",
          lambda mc: at_sizes(mc, lambda p: _averaged(mc, p))),
    Check("period 1 is synchronous SGD: 5 steps match one process",
          lambda mc: at_sizes(mc, lambda p: _synchronous(mc, p))),
    Check("period 4, 10 steps: every rank matches the serial simulation",
          lambda mc: at_sizes(mc, lambda p: _periodic(mc, p))),
)
check = checker(CHECKS)
