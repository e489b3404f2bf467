"""Lesson 14's run: Franke's net trained step by step, checkpointed, interrupted, resumed.

:func:`run` trains lesson 05's workload on a backend for a number of steps, with gradients
averaged across ranks (``"ddp"``, lesson 05) or the optimizer's state sharded (``"zero1"``,
lesson 10's ShardedOptimizer), and with :mod:`pcourse.resume`'s checkpoints every
``every`` steps. Each step draws from all three generators, as real loops do (dropout,
augmentation, a library's numpy): Python's decides whether the batch's inputs are jittered,
numpy's how much, torch's the noise. So a resume that forgets a generator, the data's
position or the optimizer's state goes elsewhere, and :func:`compare` says by how much.
"""

from __future__ import annotations

import random
import shutil
import time
import warnings
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pcourse import resume
from pcourse.backends.base import Backend
from pcourse.data_parallel import average_gradients_flat
from pcourse.loop import local_batches
from pcourse.sharding import ShardedOptimizer
from pcourse.workloads.franke import FrankeConfig, make_data, make_model

if TYPE_CHECKING:
    from pcourse.backends.torch_dist import GlooBackend

STRATEGIES = ("ddp", "zero1")
# 480 points, a global batch of 48: 10 steps an epoch, equal shares at 2, 3 and 4 ranks.
CONFIG = FrankeConfig.quick(n_points=480, batch_size=48)


def seed_generators(seed: int, rank: int) -> None:
    """What a fresh process does first: every generator seeded, differently per rank."""
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def build(backend: Backend, strategy: str, config: FrankeConfig = CONFIG
          ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh model, optimizer and schedule, as a new process builds them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    model = make_model(config.hidden, config.seed)
    lr, decay = config.lr, config.weight_decay
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=lr, weight_decay=decay) if strategy == "ddp"
        else ShardedOptimizer(model.parameters(), torch.optim.Adam, backend=backend, lr=lr,
                              weight_decay=decay))
    return model, opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=config.gamma)


def run(backend: Backend, steps: int, *, strategy: str = "ddp", root: str | None = None,
        every: int = 0, stop_at: int | None = None, resume_from: str | None = None,
        forget: Iterable[str] = (), check: bool = True, config: FrankeConfig = CONFIG,
        pause: float = 0.0, fail_at: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train to ``steps`` (or until ``stop_at``: the run dies there), saving under ``root``
    every ``every`` steps; ``resume_from`` a checkpoint folder first (``forget``, ``check``:
    :func:`pcourse.resume.load`'s). ``pause``: seconds to sleep after each step (a slower
    run, to be killed in); ``fail_at=(rank, step)``: that rank raises before that step.
    Returns the state and the seconds each save and load took.
    """
    torch.set_num_threads(1)
    seed_generators(config.seed, backend.rank)
    model, opt, sched = build(backend, strategy, config)
    progress, said, load_s = resume.Progress(seed=config.seed), "started afresh", None
    if resume_from is not None:
        t0 = time.perf_counter()
        progress, said = resume.load(resume_from, backend, model, opt, sched,
                                     forget=forget, check=check)
        load_s = time.perf_counter() - t0
    x, y = make_data(config.n_points, config.seed)
    local = config.batch_size // backend.size
    save_s: list[float] = []
    while progress.step < steps and progress.step != stop_at:
        batches = local_batches(config.n_points, backend.rank, backend.size, local,
                                progress.seed, progress.epoch)
        for idx in batches[progress.batch:]:
            if fail_at == (backend.rank, progress.step):
                raise RuntimeError(f"rank {backend.rank} fails on purpose before step "
                                   f"{progress.step}")
            time.sleep(pause)
            xb = x[idx]
            if random.random() < 0.75:  # Python's generator
                xb = xb + float(np.random.uniform(0, 0.02)) * torch.randn_like(xb)  # numpy, torch
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), y[idx], reduction="sum")
            (loss / len(idx)).backward()
            if strategy == "ddp":
                average_gradients_flat(model, backend, check=progress.step == 0)
            opt.step()
            total = torch.tensor([loss.item(), len(idx)], dtype=torch.float64)
            backend.allreduce(total, "sum", check=False)
            progress.losses.append((total[0] / total[1]).item())
            progress.step, progress.batch = progress.step + 1, progress.batch + 1
            if root is not None and every and progress.step % every == 0:
                t0 = time.perf_counter()
                resume.save(root, backend, model, opt, progress, sched)
                save_s.append(time.perf_counter() - t0)
            if progress.step in (steps, stop_at):
                break
        else:
            progress = replace(progress, epoch=progress.epoch + 1, batch=0)
            with warnings.catch_warnings():  # resumed at an epoch's end: its steps were taken
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                sched.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
            "optimizer": opt.state_dict(), "losses": torch.tensor(progress.losses,
                                                                  dtype=torch.float64),
            "step": progress.step, "said": said, "save_s": save_s, "load_s": load_s}


def _equal(a: Any, b: Any) -> bool:
    """Nested state (dicts, lists, tensors, numbers) equal bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def compare(reference: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    """This rank's resumed run against the uninterrupted one: each part equal bit for bit,
    and the largest difference of the parameters and of the losses."""
    p, q = reference["params"], resumed["params"]
    la, lb = reference["losses"], resumed["losses"]
    same_len = len(la) == len(lb)
    return {"params": torch.equal(p, q), "optimizer": _equal(reference["optimizer"],
                                                             resumed["optimizer"]),
            "losses": same_len and torch.equal(la, lb),
            "param_diff": (p - q).abs().max().item(),
            "loss_diff": (la - lb).abs().max().item() if same_len else float("inf")}


def tear(root: str | Path, rank: int, size: int) -> None:
    """On rank 0: make the newest checkpoint under ``root`` torn, as a writer that
    overwrites in place leaves it when it dies: no manifest, and the last rank's file
    still the one of the checkpoint before (its new one never landed)."""
    if rank == 0:
        new, old = sorted(Path(root).glob("step-*"), reverse=True)[:2]
        (new / resume.MANIFEST).unlink()
        last = f"rank{size - 1:05d}.pt"
        shutil.copy(old / last, new / last)


CONTROLS: dict[str, dict[str, Any]] = {"no generator state": {"forget": ["rng"]},
            "no data position": {"forget": ["position"]},
            "no optimizer state": {"forget": ["optimizer"]},
            "a torn write accepted": {"check": False}}


def exactness(backend: Backend, root: str, strategy: str, steps: int = 24, every: int = 5,
              dies_at: int = 18) -> dict[str, Any]:
    """Collective: the run never interrupted; the run dying at ``dies_at`` after saving
    every ``every`` steps, its last checkpoint torn (it died saving it), resumed; and the
    four resumes that each lose one thing. This rank's comparisons."""
    reference = run(backend, steps, strategy=strategy)
    run(backend, steps, strategy=strategy, root=root, every=every, stop_at=dies_at)
    barrier(backend)
    tear(root, backend.rank, backend.size)
    barrier(backend)
    resumed = run(backend, steps, strategy=strategy, resume_from=root)
    wrong = {name: run(backend, steps, strategy=strategy, resume_from=root, **how)
             for name, how in CONTROLS.items()}
    return {"resumed": compare(reference, resumed), "said": resumed["said"],
            "load_s": resumed["load_s"],
            "controls": {name: compare(reference, out) for name, out in wrong.items()},
            "losses": {"uninterrupted": reference["losses"].tolist(),
                       "resumed": resumed["losses"].tolist(),
                       **{name: out["losses"].tolist() for name, out in wrong.items()}}}


def barrier(backend: Backend) -> None:
    """Wait for every rank (an allreduce: every backend has one, with its deadline)."""
    backend.allreduce(torch.zeros(1), "sum", check=False)


def first_ranks(p: int, name: str = "mpi", timeout: float | None = None) -> Backend | None:
    """On an engine: a backend over the job's first ``p`` ranks; None on the others."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    part = world.Split(0 if world.rank < p else MPI.UNDEFINED, world.rank)
    if part == MPI.COMM_NULL:
        return None
    from pcourse.backends import make_backend

    return make_backend(name, comm=part, timeout=timeout)


def versus_dcp(backend: GlooBackend, ours: str, theirs: str, strategy: str = "ddp",
               repeats: int = 5) -> dict[str, Any]:
    """Collective, on a torch.distributed backend (Gloo): the newest checkpoint under
    ``ours`` loaded, saved again with ours and with torch.distributed.checkpoint (DCP), each
    loaded into a fresh model and optimizer, and compared; seconds per save and load.

    A sharded optimizer's state goes to DCP under a key of each rank's own: under one key
    DCP would take the ranks' different shards for copies of one tensor and keep one.
    """
    import torch.distributed.checkpoint as dcp

    model, opt, sched = build(backend, strategy)
    resume.load(ours, backend, model, opt, sched)
    key = "optimizer" if strategy == "ddp" else f"optimizer{backend.rank}"

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        m, o, s = build(backend, strategy)  # one step, so that the optimizer's state exists
        m(torch.rand(4, 2)).sum().backward()
        o.step()
        return m, o, s

    times: dict[str, list[float]] = {k: [] for k in ("ours save", "ours load", "DCP save",
                                                     "DCP load")}
    progress = resume.Progress(step=10**6)
    for i in range(repeats):
        barrier(backend)
        t0 = time.perf_counter()
        resume.save(f"{theirs}/ours", backend, model, opt, progress, sched, keep=1)
        times["ours save"].append(time.perf_counter() - t0)
        m1, o1, s1 = fresh()
        barrier(backend)
        t0 = time.perf_counter()
        resume.load(f"{theirs}/ours", backend, m1, o1, s1)
        times["ours load"].append(time.perf_counter() - t0)
        barrier(backend)
        t0 = time.perf_counter()
        dcp.save({"model": model.state_dict(), key: opt.state_dict()},
                 checkpoint_id=f"{theirs}/dcp{i}", process_group=backend.group)
        times["DCP save"].append(time.perf_counter() - t0)
        m2, o2, _ = fresh()
        state = {"model": m2.state_dict(), key: o2.state_dict()}
        barrier(backend)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=f"{theirs}/dcp{i}", process_group=backend.group)
        m2.load_state_dict(state["model"])
        o2.load_state_dict(state[key])
        times["DCP load"].append(time.perf_counter() - t0)
    equal = all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(),
                                                 strict=True)) \
        and _equal(o1.state_dict(), o2.state_dict()) \
        and _equal(o1.state_dict(), opt.state_dict())
    return {"equal": equal, "times": times}


def how_it_ends(backend: Backend, steps: int, fail_at: tuple[int, int]) -> tuple[str, float]:
    """Collective: :func:`run` with one rank raising at ``fail_at=(rank, step)``; how this
    rank's run ended (the error's type and first sentence) and after how many seconds."""
    started = time.monotonic()
    try:
        run(backend, steps, fail_at=fail_at)
        ending = "finished"
    except Exception as exc:  # noqa: BLE001 - reported, rank by rank
        ending = f"{type(exc).__name__}: {str(exc).split('. ')[0]}"
    return ending, time.monotonic() - started
