"""Lesson 14's run: Franke's net (or the VAE) trained step by step, checkpointed,
interrupted, resumed.

:func:`run` trains lesson 05's workload on a backend for a number of steps, with gradients
averaged across ranks (``"ddp"``, lesson 05), the optimizer's state sharded (``"zero1"``,
lesson 10's ShardedOptimizer) or the parameters too (``"fsdp"``, lesson 10's), and with
:mod:`pcourse.resume`'s checkpoints every ``every`` steps. Each step draws from all three
generators, as real loops do (dropout, augmentation, a library's numpy): Python's decides
whether the batch's inputs are jittered, numpy's how much, torch's the noise. So a resume
that forgets a generator, the data's position or the optimizer's state goes elsewhere, and
:func:`compare` says by how much. The VAE draws its noise from a table of the epoch
instead (lesson 06), so it needs no generator state.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
import torch
from torch import nn

from pcourse import resume
from pcourse.backends.base import Backend
from pcourse.data_parallel import average_gradients_flat
from pcourse.loop import local_batches
from pcourse.notices import failing_loudly
from pcourse.sharding import FullyShardedDataParallel, ShardedOptimizer
from pcourse.workloads import vae
from pcourse.workloads.config import MNISTConfig
from pcourse.workloads.franke import FrankeConfig, make_data, make_model

if TYPE_CHECKING:
    from pcourse.backends.torch_dist import GlooBackend

STRATEGIES = ("ddp", "zero1")  # what the lesson runs; "fsdp" too (lesson 10's), in the tests
BUILDS = (*STRATEGIES, "fsdp")
# 480 points, a global batch of 48: 10 steps an epoch, equal shares at 2, 3 and 4 ranks.
CONFIG = FrankeConfig.quick(n_points=480, batch_size=48)
# The VAE (lesson 06) on 480 MNIST images, the same schedule: its noise is no generator's
# draw but a table of the epoch, looked up by sample (pcourse.workloads.vae)
VAE_CONFIG = MNISTConfig.quick(limit=480, batch_size=48, n_eval=10)
Config = FrankeConfig | MNISTConfig


def seed_generators(seed: int, rank: int) -> None:
    """What a fresh process does first: every generator seeded, differently per rank."""
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def build(backend: Backend, strategy: str, config: Config = CONFIG
          ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh model, optimizer and schedule, as a new process builds them (Franke's net,
    or the VAE for an MNISTConfig)."""
    if strategy not in BUILDS:
        raise ValueError(f"strategy must be one of {BUILDS}, got {strategy!r}")
    model: nn.Module = vae.make_model(config.latent, config.seed) \
        if isinstance(config, MNISTConfig) else make_model(config.hidden, config.seed)
    lr, decay = config.lr, config.weight_decay
    if strategy == "fsdp":  # each Linear a unit: a rank holds a slice of its weights
        model = FullyShardedDataParallel(model, backend, shard=nn.Linear)
    opt: torch.optim.Optimizer = (
        ShardedOptimizer(model.parameters(), torch.optim.Adam, backend=backend, lr=lr,
                         weight_decay=decay) if strategy == "zero1"
        else torch.optim.Adam(model.parameters(), lr=lr, weight_decay=decay))
    return model, opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=config.gamma)


def run(backend: Backend, steps: int, *, strategy: str = "ddp", root: str | None = None,
        every: int = 0, stop_at: int | None = None, resume_from: str | None = None,
        forget: Iterable[str] = (), check: bool = True, config: Config = CONFIG,
        pause: float = 0.0, fail_at: tuple[int, int] | None = None, reshard: bool = False,
        jitter: bool = True, kill_at: tuple[int, int, str] | None = None) -> dict[str, Any]:
    """Train to ``steps`` (or until ``stop_at``: the run dies there), saving under ``root``
    every ``every`` steps; ``resume_from`` a checkpoint folder first (``forget``, ``check``:
    :func:`pcourse.resume.load`'s). ``pause``: seconds to sleep after each step (a slower
    run, to be killed in); ``fail_at=(rank, step)``: that rank raises before that step.
    ``reshard``: the checkpoint may be another rank count's; ``jitter=False``: no noise
    (each rank draws its own, so a run at another rank count draws other noise).
    ``kill_at=(rank, step, where)``: that rank kills itself with SIGKILL at that step,
    where is one of :data:`KILLED_IN` (in compute: before the step's forward; in a
    collective: having started the step's last allreduce; in a checkpoint write: in the
    save of checkpoint ``step``, once its own file is on disk, before the manifest: the
    checkpoint is torn). Returns the state and the seconds each save and load took.
    """
    if kill_at is not None and kill_at[2] not in KILLED_IN:
        raise ValueError(f"kill_at's place must be one of {KILLED_IN}, got {kill_at[2]!r}")
    torch.set_num_threads(1)
    seed_generators(config.seed, backend.rank)
    model, opt, sched = build(backend, strategy, config)
    progress, said, load_s = resume.Progress(seed=config.seed), "started afresh", None
    if resume_from is not None:
        t0 = time.perf_counter()
        progress, said = resume.load(resume_from, backend, model, opt, sched,
                                     forget=forget, check=check, reshard=reshard)
        load_s = time.perf_counter() - t0
    n, loss_sum = _batch_loss(config, jitter)
    local = config.batch_size // backend.size
    save_s: list[float] = []
    while progress.step < steps and progress.step != stop_at:
        batches = local_batches(n, backend.rank, backend.size, local,
                                progress.seed, progress.epoch)
        for idx in batches[progress.batch:]:
            dies = kill_at[2] if kill_at and kill_at[:2] == (backend.rank, progress.step) \
                else None
            if dies == "compute":
                _die()
            if fail_at == (backend.rank, progress.step):
                raise RuntimeError(f"rank {backend.rank} fails on purpose before step "
                                   f"{progress.step}")
            time.sleep(pause)
            opt.zero_grad()
            loss = loss_sum(model, idx, progress.epoch)
            (loss / len(idx)).backward()
            if strategy == "ddp":
                average_gradients_flat(model, backend, check=progress.step == 0)
            elif isinstance(model, FullyShardedDataParallel):  # the replicated biases
                model.finish()
            opt.step()
            total = torch.tensor([loss.item(), len(idx)], dtype=torch.float64)
            if dies == "collective":  # in it: the others' allreduce has this rank's start
                backend.allreduce_async(total, "sum", check=False)
                _die()
            backend.allreduce(total, "sum", check=False)
            progress.losses.append((total[0] / total[1]).item())
            progress.step, progress.batch = progress.step + 1, progress.batch + 1
            if root is not None and every and progress.step % every == 0:
                t0 = time.perf_counter()
                dying = kill_at == (backend.rank, progress.step, "save")
                with _dying_in_save() if dying else nullcontext():
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


KILLED_IN = ("compute", "collective", "save")


def _batch_loss(config: Config, jitter: bool) -> tuple[int, Any]:
    """The sample count, and a batch's summed loss ``(model, indices, epoch)``. Franke's
    draws from all three generators (``jitter``); the VAE's noise is its workload's table
    of the epoch, the same on every rank."""
    if isinstance(config, MNISTConfig):
        workload = vae.make_workload(config)
        return workload.n_train, workload.loss_sum
    x, y = make_data(config.n_points, config.seed)

    def loss_sum(model: nn.Module, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        xb = x[idx]
        if jitter and random.random() < 0.75:  # Python's generator
            xb = xb + float(np.random.uniform(0, 0.02)) * torch.randn_like(xb)  # numpy, torch
        return nn.functional.mse_loss(model(xb), y[idx], reduction="sum")

    return config.n_points, loss_sum


def _die() -> None:
    """SIGKILL to this process: no handler runs, no file is closed, nothing is said."""
    os.kill(os.getpid(), signal.SIGKILL)


def _dying_in_save() -> Any:
    """While saving: die once this rank's file is renamed into place (the folder's fsync
    that follows it), so the others wait for it in the save's agreement, and no manifest
    is ever written."""
    return mock.patch.object(resume, "_fsync_folder", lambda folder: _die())


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
              dies_at: int = 18, config: Config = CONFIG) -> dict[str, Any]:
    """Collective: the run never interrupted; the run dying at ``dies_at`` after saving
    every ``every`` steps, its last checkpoint torn (it died saving it), resumed; and the
    four resumes that each lose one thing. This rank's comparisons."""
    reference = run(backend, steps, strategy=strategy, config=config)
    run(backend, steps, strategy=strategy, root=root, every=every, stop_at=dies_at,
        config=config)
    barrier(backend)
    tear(root, backend.rank, backend.size)
    barrier(backend)
    resumed = run(backend, steps, strategy=strategy, resume_from=root, config=config)
    wrong = {name: run(backend, steps, strategy=strategy, resume_from=root, config=config,
                       **how) for name, how in CONTROLS.items()}
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
    """Collective: :func:`run` with one rank raising at ``fail_at=(rank, step)``, inside
    :func:`pcourse.notices.failing_loudly`; how this rank's run ended (the error's type
    and first sentence) and after how many seconds."""
    started = time.monotonic()
    try:
        with failing_loudly(backend):
            run(backend, steps, fail_at=fail_at)
        ending = "finished"
    except Exception as exc:  # noqa: BLE001 - reported, rank by rank
        ending = f"{type(exc).__name__}: {str(exc).split('. ')[0]}"
    return ending, time.monotonic() - started


def resharding(old_p: int, new_p: int, root: str, strategy: str, at: int = 15,
               name: str = "mpi", timeout: float | None = None) -> dict[str, Any]:
    """On every rank of a job of at least ``old_p`` ranks: the first ``old_p`` train ``at``
    steps without noise and save, then (the reference) train from scratch to ``at + 1``;
    the first ``new_p`` load that checkpoint re-cut for ``new_p`` ranks, once as loaded
    and once after one step more. This rank's part of each (see :func:`resharded`)."""
    out: dict[str, Any] = {}
    old = first_ranks(old_p, name, timeout)
    if old is not None:
        saved = run(old, at, strategy=strategy, root=root, every=at, jitter=False)
        after = run(old, at + 1, strategy=strategy, jitter=False)
        out["old"] = (saved, after)
        old.close()
    new = first_ranks(new_p, name, timeout)  # every rank: after the old ranks have saved
    if new is not None:
        loaded = run(new, at, strategy=strategy, resume_from=root, reshard=True,
                     jitter=False)
        after = run(new, at + 1, strategy=strategy, resume_from=root, reshard=True,
                    jitter=False)
        out["new"] = (loaded, after)
        new.close()
    return out


def _whole(states: list[dict[str, Any]]) -> dict[tuple[int, str], torch.Tensor]:
    """A ZeRO-1 optimizer's state, its ranks' slices end to end (padding included)."""
    local = [s["local"]["state"] for s in states]
    return {(i, k): torch.cat([loc[i][k] for loc in local]) if local[0][i][k].dim() else
            local[0][i][k] for i in local[0] for k in local[0][i]}


def _same_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Two rank counts' optimizer states equal bit for bit: a replicated one rank 0's,
    a ZeRO-1 one its whole vectors (the shorter's padding aside; the longer's is zero)."""
    if "local" not in a[0]:
        return _equal(a[0], b[0])
    wa, wb = _whole(a), _whole(b)
    if wa.keys() != wb.keys():
        return False
    for key, x in wa.items():
        y, n = wb[key], min(wa[key].numel(), wb[key].numel())
        if x.dim() == 0 and not torch.equal(x, y):  # a count (Adam's step)
            return False
        if x.dim() and not (torch.equal(x[:n], y[:n]) and not x[n:].any() and not y[n:].any()):
            return False
    return True


def resharded(outs: list[dict[str, Any]], at: int = 15) -> dict[str, Any]:
    """:func:`resharding`'s results from every rank, compared: the state as loaded (the
    parameters, and the optimizer's state) bit for bit against the state saved; after one
    step, the loss and the parameters against the old rank count's own step."""
    old = [o["old"] for o in outs if "old" in o]
    new = [o["new"] for o in outs if "new" in o]
    (saved, ref), (loaded, step) = old[0], new[0]
    p, q = ref["params"], step["params"]
    return {"params loaded": all(torch.equal(saved["params"], n[0]["params"]) for n in new),
            "optimizer loaded": _same_state([o[0]["optimizer"] for o in old],
                                            [n[0]["optimizer"] for n in new]),
            "loss": (ref["losses"][at].item(), step["losses"][at].item()),
            "loss bitwise": bool(ref["losses"][at] == step["losses"][at]),
            "params bitwise": torch.equal(p, q),
            "params rel diff": ((p - q).abs() / p.abs()).max().item(),
            "said": loaded["said"]}


def main(argv: list[str] | None = None) -> int:
    """Under mpiexec (``python -m pcourse.tools.bench.restart --kill RANK STEP WHERE``):
    :func:`run`, saving every 5 steps under ``--root``, with one rank killing itself; each
    rank that is left says how its run ended, and after how many seconds."""
    import argparse

    from pcourse.backends import make_backend

    parser = argparse.ArgumentParser(prog="python -m pcourse.tools.bench.restart")
    parser.add_argument("--kill", nargs=3, metavar=("RANK", "STEP", "WHERE"), required=True)
    parser.add_argument("--root", required=True, help="where the checkpoints go")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds a collective waits for a missing rank")
    args = parser.parse_args(argv)
    backend = make_backend("mpi", timeout=args.deadline)
    rank, step, where = int(args.kill[0]), int(args.kill[1]), args.kill[2]
    started = time.monotonic()
    try:
        run(backend, args.steps, root=args.root, every=5, kill_at=(rank, step, where))
        ending, code = "finished", 0
    except Exception as exc:  # noqa: BLE001 - reported, rank by rank
        ending, code = f"{type(exc).__name__}: {str(exc).split('. ')[0]}", 1
    print(f"rank {backend.rank} after {time.monotonic() - started:.1f} s: {ending}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
