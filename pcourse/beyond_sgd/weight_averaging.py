"""Averaging weights instead of gradients: local SGD, federated averaging, once at the end.

:func:`run_method` runs one of :data:`METHODS` on this rank's shards of Franke's
regression (:mod:`pcourse.workloads.franke`), with a small network and SGD written
out by hand (optionally with momentum), so the methods differ only in what they
average and when; "exact" (gradients averaged every step) is the reference.
:func:`interpolation_losses` measures the straight path between two models.

Lesson 08 explains when averaging weights equals exact SGD (plain SGD and momentum
at ``k = 1``, not Adam) and why averaging once at the end can fail.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from pcourse.backends import Backend
from pcourse.data_parallel import average_gradients_flat, check_same_model
from pcourse.partition import partition_indices
from pcourse.runtime.ranks import threads
from pcourse.workloads.franke import make_data, make_model

METHODS = ("exact", "local", "fedavg", "once")


@dataclass(frozen=True)
class Setup:
    """One experiment's sizes; ``Setup.quick()`` is the one the tests and notebooks run."""

    n_train: int = 4096
    n_test: int = 1024
    hidden: int = 32
    batch: int = 16  # per rank, per step
    lr: float = 0.05
    momentum: float = 0.0  # heavy-ball momentum, as torch.optim.SGD (no dampening)
    steps: int = 2000
    eval_every: int = 50
    seed: int = 12345
    dtype: str = "float32"
    shards: str = "iid"  # "iid": random shards; "split": rank r owns the r-th strip in x

    @classmethod
    def quick(cls, **changes: Any) -> Setup:
        return dataclasses.replace(cls(steps=600, eval_every=25), **changes)


def make_problem(setup: Setup) -> tuple[torch.Tensor, ...]:
    """Training and test data, identical on every rank (seeded), in ``setup.dtype``."""
    dtype = getattr(torch, setup.dtype)
    return (*make_data(setup.n_train, setup.seed, dtype),
            *make_data(setup.n_test, setup.seed + 1, dtype))


def new_model(setup: Setup, seed_offset: int = 0) -> nn.Module:
    """The same network on every rank, unless ``seed_offset`` differs between ranks."""
    dtype = getattr(torch, setup.dtype)
    return make_model(setup.hidden, setup.seed + seed_offset).to(dtype)


def batch_indices(step: int, rank: int, size: int, setup: Setup) -> torch.Tensor:
    """The sample indices rank ``rank`` uses at ``step``: a pure function, so a serial
    reference can replay every rank's batches exactly.

    Each epoch reshuffles (seed + epoch) and gives every rank its own disjoint shard.
    """
    per_rank = setup.n_train // size
    per_epoch = per_rank // setup.batch
    if per_epoch < 1:
        raise ValueError(f"batch {setup.batch} is larger than a rank's shard ({per_rank})")
    epoch, j = divmod(step, per_epoch)
    if setup.shards == "split":
        shard = _strips(setup, size)[rank]
        gen = torch.Generator().manual_seed(setup.seed + 1000 * epoch + rank)
        shard = shard[torch.randperm(len(shard), generator=gen)]
    elif setup.shards == "iid":
        shard = partition_indices(setup.n_train, rank, size, seed=setup.seed, epoch=epoch)
    else:
        raise ValueError(f"shards must be 'iid' or 'split', got {setup.shards!r}")
    return shard[j * setup.batch:(j + 1) * setup.batch]


@functools.lru_cache(maxsize=8)
def _strips(setup: Setup, size: int) -> list[torch.Tensor]:
    """Non-IID shards: sort the points by x, give rank r the r-th strip of the domain.

    Each rank then sees a different part of the function, as federated clients see
    different users: their local solutions disagree, and averaging must reconcile them.
    """
    x = make_data(setup.n_train, setup.seed)[0]
    per = setup.n_train // size
    order = torch.argsort(x[:, 0], stable=True)
    return [order[r * per:(r + 1) * per] for r in range(size)]


@torch.no_grad()
def average_parameters(model: nn.Module, backend: Backend, weight: float = 1.0,
                       check: bool = True) -> float:
    """Replace the weights by the ``weight``-weighted mean over ranks; return the total weight.

    One allreduce of [weight * w, weight]: the weights and their normaliser travel in
    the same message. A rank with weight 0 contributes nothing but still receives the
    result, which is how federated averaging leaves out unselected ranks. ``check``:
    the backend's check that every rank passed the same length (skip it once known).
    """
    vec = parameters_to_vector(model.parameters())
    buf = torch.cat([vec * weight, vec.new_tensor([weight])])
    backend.allreduce(buf, "sum", check=check)
    total = float(buf[-1])
    if total <= 0:
        raise ValueError("no rank contributed a positive weight: select at least one rank")
    vector_to_parameters(buf[:-1] / total, model.parameters())
    return total


def select_ranks(size: int, fraction: float, seed: int, round_: int) -> list[int]:
    """The ranks that train in federated round ``round_``: the same answer on every rank.

    Like the partitioner, every rank draws from a generator with the same seed, so
    they agree on the selection without a message. At least one rank is chosen.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    m = max(1, round(fraction * size))
    gen = torch.Generator().manual_seed(seed * 7919 + round_)
    return sorted(torch.randperm(size, generator=gen)[:m].tolist())


@dataclass
class Run:
    """What one training run measured (identical on every rank)."""

    method: str
    k: int
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # test MSE of the ranks' average model
    own_loss: list[float] = field(default_factory=list)  # mean test MSE of each rank's own model
    messages: int = 0  # model-sized allreduces used for training (not for measuring)
    final: torch.Tensor | None = None  # this rank's weights at the end ("once": before averaging)


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
             average: Callable[[nn.Module], None] | None = None,
             velocity: list[torch.Tensor] | None = None, momentum: float = 0.0
             ) -> torch.Tensor:
    """One step of SGD by hand; returns the batch's loss.

    ``average`` runs between backward and the update ("exact" passes gradient
    averaging). With ``velocity`` (one zero-initialised tensor per parameter) the
    step is heavy-ball momentum, v = momentum·v + g, w -= lr·v, as torch.optim.SGD
    does it; the velocity is this rank's own and is never averaged. The update is
    in place: under Hogwild the weights live in shared memory and several
    processes write them this way, with no lock.
    """
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if average is not None:
        average(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            assert p.grad is not None  # backward just gave every parameter one
            step = p.grad
            if velocity is not None:
                step = velocity[i].mul_(momentum).add_(p.grad)
            p.sub_(lr * step)  # in place
    return loss.detach()


def new_velocity(model: nn.Module, setup: Setup) -> list[torch.Tensor] | None:
    """Zero momentum buffers for ``model``, or None for plain SGD."""
    return [torch.zeros_like(p) for p in model.parameters()] if setup.momentum else None


@torch.no_grad()
def _measure(model: nn.Module, backend: Backend, x_test: torch.Tensor, y_test: torch.Tensor):
    """Test loss of the ranks' averaged model and the mean of their own; touches no weights."""
    own = nn.functional.mse_loss(model(x_test), y_test)
    buf = torch.cat([parameters_to_vector(model.parameters()), own.reshape(1)])
    backend.allreduce(buf, "avg", check=False)  # run_method() checked the model once
    probe = copy.deepcopy(model)
    vector_to_parameters(buf[:-1], probe.parameters())
    return nn.functional.mse_loss(probe(x_test), y_test).item(), buf[-1].item()


def run_method(
    method: str, backend: Backend, setup: Setup, *, k: int = 1, fraction: float = 1.0,
    independent_init: bool = False,
) -> Run:
    """Train with one of METHODS on this rank's shards; collective, so call it on all ranks.

    - "exact": average gradients every step (the reference).
    - "local": average weights every ``k`` steps.
    - "fedavg": every ``k`` steps is a round; only ``select_ranks(..., fraction)`` train
      in it, and the new model is their mean.
    - "once": train apart, average weights once at the end.
    ``independent_init`` seeds each rank's model differently (no common start).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    if k < 1:
        raise ValueError(f"k must be at least 1 step, got {k}")

    rank, size = backend.rank, backend.size
    x, y, x_test, y_test = make_problem(setup)
    model = new_model(setup, rank if independent_init else 0)
    velocity = new_velocity(model, setup)
    # One check that every rank holds the same shapes; the collectives below skip theirs.
    check_same_model(list(model.parameters()), backend, "model")
    run = Run(method, k)
    for step in range(setup.steps):
        active = method != "fedavg" or rank in select_ranks(size, fraction, setup.seed, step // k)
        if active:
            idx = batch_indices(step, rank, size, setup)
            average = None
            if method == "exact":
                average = functools.partial(average_gradients_flat, backend=backend, check=False)
                run.messages += 1
            sgd_step(model, x[idx], y[idx], setup.lr, average, velocity, setup.momentum)
        if method in ("local", "fedavg") and (step + 1) % k == 0:
            average_parameters(model, backend, weight=1.0 if active else 0.0, check=False)
            run.messages += 1
        if (step + 1) % setup.eval_every == 0 or step + 1 == setup.steps:
            loss, own = _measure(model, backend, x_test, y_test)  # "once": before averaging
            run.steps.append(step + 1)
            run.loss.append(loss)
            run.own_loss.append(own)
    run.final = parameters_to_vector(model.parameters()).detach().clone()
    if method == "once":
        average_parameters(model, backend, check=False)
        run.messages += 1
    return run


def serial_reference(setup: Setup, size: int) -> torch.Tensor:
    """Large-batch SGD in one process, replaying all ``size`` ranks' batches as one.

    The mean loss over the concatenated batch has gradient mean_r g_r, exactly what
    "exact" (and "local" with k = 1, with or without momentum) computes in parallel.
    """
    x, y, _, _ = make_problem(setup)
    model = new_model(setup)
    velocity = new_velocity(model, setup)
    with threads(1):
        for step in range(setup.steps):
            idx = torch.cat([batch_indices(step, r, size, setup) for r in range(size)])
            sgd_step(model, x[idx], y[idx], setup.lr, None, velocity, setup.momentum)
    return parameters_to_vector(model.parameters()).detach().clone()


@torch.no_grad()
def interpolation_losses(a: torch.Tensor, b: torch.Tensor, setup: Setup,
                         alphas: list[float]) -> list[float]:
    """Test loss along the straight line (1 - alpha) a + alpha b between two weight vectors.

    alpha = 0.5 is their average. A bump in the middle is why averaging weights of
    models that trained apart goes wrong: the line leaves the valley both lie in.
    """
    _, _, x_test, y_test = make_problem(setup)
    model = new_model(setup)
    out = []
    for alpha in alphas:  # a few test-set passes: no need to limit threads
        vector_to_parameters((1 - alpha) * a + alpha * b, model.parameters())
        out.append(nn.functional.mse_loss(model(x_test), y_test).item())
    return out
