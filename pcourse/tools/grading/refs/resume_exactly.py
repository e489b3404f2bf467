"""Exercise 12, resuming exactly (ZeRO-1): the learner's ``save`` and ``load``.

A trial trains a small ZeRO-1 run on every rank (:class:`Run`: the whole parameters, this
rank's slice of them and AdamW over it, a sampler, a dropout generator, the losses),
saving every :data:`EVERY` steps with the learner's ``save``; the job then dies (a rank
killed during a step, or a rank's disk full while it saves), and a new run, built from
scratch as a restarted job's would be, calls the learner's ``load`` and trains on. What
comes back is the run's state right after ``load`` and at the end, as wire data: the
checks never read the learner's files (only the learner's own ``load`` does, in the
learner's process), so nothing of theirs is unpickled where the verdict is printed.

The reference is every rank's run never interrupted, simulated here in one process
(:func:`uninterrupted`) with the same arithmetic in the same order: a gradient's slices are
exchanged whole (``Alltoall``) and summed in rank order, so the parallel run is bitwise
reproducible, and the resumed run must be bitwise equal to it (``torch.equal``).
"""

from __future__ import annotations

import random
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pcourse.tools.grading.checks import (
    NOT_YET,
    Check,
    Contract,
    ExerciseError,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
)
from pcourse.tools.grading.refs.common import make_data, shard_of
from pcourse.tools.grading.trials import CountingComm, check_left_behind, world

SAVE, LOAD = Learner("save"), Learner("load")

STEPS, EVERY = 12, 2  # the run's updates, and a checkpoint every EVERY of them
LOCAL, BATCH = 9, 3  # samples per rank, per batch: 3 batches an epoch, 4 epochs a run
LR, DECAY, DROP = 0.05, 0.1, 0.25  # AdamW's rate and weight decay; dropout's rate
TORN_BYTES = 64  # a file stops growing here while a disk is "full": less than any tensor
# Seconds the trial's own collectives wait for a rank (in learner code, or failed): under
# checks.RUN_TIMEOUT, so that a rank that failed is said, not a trial that never finished.
TRUSTED_TIMEOUT = 30.0


# ---------------------------------------------------------------- the run

@dataclass(frozen=True)
class Case:
    """One run's make: the parameters' dtype and the hidden layer's width."""

    dtype: torch.dtype
    hidden: int

    def n(self) -> int:
        """The MLP's parameters: 3 -> hidden -> 2."""
        return 3 * self.hidden + self.hidden + self.hidden * 2 + 2


CASES = (Case(torch.float64, 23), Case(torch.float32, 37))  # 117 and 187: 2, 3, 4 divide none


class Sampler:
    """This rank's batches: epoch e visits its samples in the order of ``seed + e``, a
    batch at a time; ``epoch`` and ``batch`` (the next one) are where it is."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch, self.batch = seed, 0, 0

    def next(self) -> torch.Tensor:
        order = torch.randperm(LOCAL, generator=torch.Generator().manual_seed(self.seed
                                                                              + self.epoch))
        idx = order[self.batch * BATCH:(self.batch + 1) * BATCH]
        self.batch += 1
        if self.batch == LOCAL // BATCH:
            self.epoch, self.batch = self.epoch + 1, 0
        return idx


class Run:
    """What one ZeRO-1 rank holds; the learner's ``save`` and ``load`` see these names.

    ``params``: every parameter, flat, padded with zeros to ``size`` equal slices (every
    rank holds all of them); ``shard``: this rank's slice, its own tensor, which ``opt``
    (AdamW) steps; ``sampler``: the data's position; ``gen``: the dropout masks' generator;
    ``step``: updates done; ``losses``: this rank's loss of each.
    """

    def __init__(self, case: Case, rank: int, size: int) -> None:
        self.rank, self.size, self.case = rank, size, case
        per = -(-case.n() // size)
        init = torch.Generator().manual_seed(7 + case.hidden)
        self.params = torch.zeros(per * size, dtype=case.dtype)
        self.params[:case.n()] = 0.5 * torch.randn(case.n(), generator=init,
                                                   dtype=torch.float64).to(case.dtype)
        self.shard = self.params[rank * per:(rank + 1) * per].clone()
        self.opt = torch.optim.AdamW([self.shard], lr=LR, weight_decay=DECAY, foreach=False)
        self.sampler = Sampler(seed=100 + rank)
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.step = 0
        self.losses: list[float] = []
        x, y = shard_of(make_data(LOCAL * size, seed=3), rank, size)
        self.x, self.y = x.to(case.dtype), y.to(case.dtype)


def _forward(run: Run, flat: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    h = run.case.hidden
    w1, b1 = flat[:3 * h].view(h, 3), flat[3 * h:4 * h]
    w2, b2 = flat[4 * h:6 * h].view(2, h), flat[6 * h:6 * h + 2]
    return (torch.tanh(x @ w1.T + b1) * mask) @ w2.T + b2


def local_gradient(run: Run) -> torch.Tensor:
    """This rank's next batch's gradient of the whole (padded) parameters, with its dropout
    mask; the loss appended to ``run.losses``. Reads the sampler and the generator."""
    idx = run.sampler.next()
    mask = (torch.rand(BATCH, run.case.hidden, generator=run.gen, dtype=run.case.dtype)
            >= DROP).to(run.case.dtype) / (1 - DROP)
    flat = run.params[:run.case.n()].clone().requires_grad_()
    loss = torch.nn.functional.mse_loss(_forward(run, flat, run.x[idx], mask), run.y[idx])
    loss.backward()
    run.losses.append(loss.item())
    grad = torch.zeros_like(run.params)
    grad[:run.case.n()] = flat.grad  # type: ignore[assignment] # set by backward
    return grad


def apply(run: Run, mine: list[torch.Tensor]) -> None:
    """AdamW on this rank's slice, the slice's gradients of every rank (rank order) given:
    summed in that order, averaged. The rest (putting the slices together) is the caller's."""
    total = mine[0].clone()
    for g in mine[1:]:
        total += g
    run.shard.grad = total / run.size
    run.opt.step()
    run.shard.grad = None
    run.step += 1


def snapshot(run: Run) -> dict:
    """Everything the next step reads, as plain data (what a trial sends back)."""
    stepped = run.opt.param_groups[0]["params"][0]
    state = run.opt.state.get(stepped, {})
    step = state.get("step")
    return {"step": run.step, "epoch": run.sampler.epoch, "batch": run.sampler.batch,
            "gen": run.gen.get_state(),
            "opt_step": None if step is None else float(step),
            "exp_avg": _copy(state.get("exp_avg")), "exp_avg_sq": _copy(state.get("exp_avg_sq")),
            "stepped_is_shard": stepped is run.shard, "shard": stepped.detach().clone(),
            "params": run.params.clone(), "losses": list(run.losses)}


def _copy(t: Any) -> torch.Tensor | None:
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


# ---------------------------------------------------------------- the trial

class _Elsewhere(Exception):
    """Another rank's learner code raised: this rank stops too (its error is theirs)."""


def _together(trusted: Any, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` (the learner's), then the ranks agree whether it raised anywhere, so
    that no rank goes on alone into the trial's collectives, to wait there for one that
    left (:mod:`.common`: a trial's own calls come before the learner's, or agree so)."""
    try:
        value, error = fn(*args), None
    except Exception as exc:  # noqa: BLE001 - the learner's, said by the rank it came from
        value, error = None, exc
    failed = np.array([0 if error is None else 1], dtype=np.int64)
    trusted.Allreduce(failed.copy(), failed)
    if error is not None:
        raise error
    if failed[0]:
        raise _Elsewhere
    return value


def full_disk(fn: Callable, *args: Any) -> BaseException | None:
    """``fn(*args)`` while no file of this process may grow past :data:`TORN_BYTES` (as a
    disk that fills up mid-write): its writes fail (EFBIG), leaving what fitted. Returns
    what it raised. The signal the kernel sends (SIGXFSZ, which would end the process) is
    blocked in this thread and taken back before it is unblocked."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGXFSZ})
    resource.setrlimit(resource.RLIMIT_FSIZE, (TORN_BYTES, hard))
    try:
        fn(*args)
        return None
    except Exception as exc:  # noqa: BLE001 - the write that failed, expected
        return exc
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        while signal.sigtimedwait({signal.SIGXFSZ}, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGXFSZ})


def resume_trial(save: Callable, load: Callable, which: int,
                 deaths: list[list[int | None]]) -> dict:
    """Jobs that die, then one that finishes, on this rank, in one folder of its own, for
    the run of ``CASES[which]`` (a number: what crosses to the learner's side is data).

    Each job builds its run from scratch, loads (the first finds nothing: its first
    start), trains, saving every :data:`EVERY` steps; job j dies as ``deaths[j]`` says,
    ``[die_at, torn_rank]``: during step ``die_at``, or, where ``torn_rank`` is a rank,
    once step ``die_at`` is done, while that rank saves it with its disk full (the others'
    saves of it complete). The last job trains to :data:`STEPS`. Returns what each
    ``load`` returned, the state after it, and the state at the end; a learner's error on
    one rank ends the trial on every rank.
    """
    case, comm = CASES[which], world()
    # The trial's own calls on a communicator of their own, never freed (as exercise 10's:
    # a freed context is reused, and a failed run's messages would meet the next one's).
    trusted = CountingComm(comm.Dup(), timeout=TRUSTED_TIMEOUT)
    mine = CountingComm(comm)
    folder = tempfile.mkdtemp(prefix="pcourse-resume-")
    out: dict = {"loads": [], "states": []}
    warm = torch.zeros(1)  # a process's first AdamW step imports torch's compiler (seconds):
    warm.grad = torch.zeros(1)  # paid here, before any rank waits for another
    torch.optim.AdamW([warm], foreach=False).step()
    try:
        for job in range(len(deaths) + 1):
            job_run = Run(case, comm.rank, comm.size)  # a new job: nothing kept of the last
            out["loads"].append(_together(trusted, _load, load, folder, job_run, mine))
            out["states"].append(_together(trusted, snapshot, job_run))
            steps = _steps(trusted, job_run)
            if len(set(steps)) > 1:
                out["steps"] = steps
                return out  # ranks at different steps would wait for each other
            die_at, torn_rank = deaths[job] if job < len(deaths) else (None, None)
            _train(job_run, trusted, save, folder, die_at, torn_rank)
        out["final"] = snapshot(job_run)
        return out
    except _Elsewhere:
        return {"elsewhere": True}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _step(run: Run, trusted: Any) -> None:
    """One ZeRO-1 step on the ranks: each rank's slices of the gradient exchanged whole
    (``Alltoall``), the slice stepped, the slices gathered into every rank's ``params``.
    What may fail on one rank (the run as ``load`` left it) is agreed before each exchange."""
    grad = _together(trusted, _local, run)
    got = np.empty_like(grad)
    trusted.Alltoall(grad, got)
    _together(trusted, apply, run, [torch.from_numpy(row) for row in got])
    trusted.Allgather(run.shard.numpy(), run.params.numpy())


def _local(run: Run) -> np.ndarray:
    """This rank's gradient, by slices, once the run's tensors are what the exchange needs."""
    per = -(-run.case.n() // run.size)
    for name, t, n in (("run.params", run.params, per * run.size), ("run.shard", run.shard, per)):
        if not (isinstance(t, torch.Tensor) and t.shape == (n,) and t.dtype == run.case.dtype
                and t.is_contiguous()):
            what = (f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
                    if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"after load, {name} is {what}; the run's is a contiguous "
                             f"{str(run.case.dtype).removeprefix('torch.')} tensor of ({n},)")
    return local_gradient(run).numpy().reshape(run.size, -1)


def _train(run: Run, trusted: Any, save: Callable, folder: str, die_at: int | None,
           torn_rank: int | None) -> None:
    """Train to :data:`STEPS`, saving every :data:`EVERY` steps, or die as said."""
    while run.step < STEPS:
        if run.step + 1 == die_at and torn_rank is None:
            return  # killed during this step: nothing of it reaches the disk
        _step(run, trusted)
        if run.step == die_at:  # torn_rank's disk fills while it saves this step
            if trusted.rank == torn_rank:
                full_disk(save, folder, run)  # it fails (or not): this job ends either way
                _together(trusted, lambda: None)
            else:
                _together(trusted, save, folder, run)
            return
        if run.step % EVERY == 0:
            _together(trusted, save, folder, run)


def _steps(trusted: Any, run: Run) -> list[int]:
    """Every rank's ``run.step`` after ``load``: they train together only if all agree."""
    steps = np.empty(run.size, dtype=np.int64)
    mine = run.step if isinstance(run.step, int) else -1  # the learner's to set: any value
    trusted.Allgather(np.array([mine], dtype=np.int64), steps)
    return steps.tolist()


def _load(load: Callable, folder: str, run: Run, comm: CountingComm) -> Any:
    """The learner's ``load``, which must leave no request or communicator behind."""
    step = load(folder, run, comm)
    check_left_behind(comm, getattr(load, "__name__", "load"))
    return step if isinstance(step, int | float | str | type(None)) else repr(step)


# ---------------------------------------------------------------- the reference

_runs: dict[tuple[Case, int], list[list[dict]]] = {}


def uninterrupted(case: Case, size: int) -> list[list[dict]]:
    """Every rank's :func:`snapshot` after each step 0..STEPS of the run never interrupted,
    simulated in this process: the same arithmetic as :func:`_step`, the slices of
    every rank's gradient summed in rank order."""
    if (case, size) not in _runs:
        ranks = [Run(case, r, size) for r in range(size)]
        states = [[snapshot(r)] for r in ranks]
        for _ in range(STEPS):
            grads = [local_gradient(r).reshape(size, -1) for r in ranks]
            for r in ranks:
                apply(r, [g[r.rank] for g in grads])
            whole = torch.cat([r.shard for r in ranks])
            for r in ranks:
                r.params.copy_(whole)
                states[r.rank].append(snapshot(r))
        _runs[(case, size)] = states
    return _runs[(case, size)]


def resumable(size: int) -> list[int]:
    """The steps a check may resume from: a checkpoint's, mid-epoch of an epoch after the
    first (so that a lost batch, epoch, generator or step count each shows), with a
    checkpoint after it before the end (so that a save can be torn after it)."""
    per = LOCAL // BATCH
    return [k for k in range(EVERY, STEPS - EVERY + 1, EVERY) if k % per and k // per]


# ---------------------------------------------------------------- comparing

PARTS = (  # (key, what it is, what losing it means), in the order a resume reads them
    ("step", "run.step", "the step count goes on from the checkpoint's"),
    ("epoch", "run.sampler.epoch", "the data's position: which epoch's order"),
    ("batch", "run.sampler.batch", "the data's position: the next batch of the epoch, "
     "not the epoch's first again"),
    ("gen", "run.gen's state", "the generator: the resumed run would draw the dropout "
     "masks of other steps"),
    ("opt_step", "the optimizer's step count", "Adam's bias correction reads it"),
    ("exp_avg", "the optimizer's exp_avg", "Adam's first moment, this rank's slice"),
    ("exp_avg_sq", "the optimizer's exp_avg_sq", "Adam's second moment, this rank's slice"),
    ("stepped_is_shard", "whether run.opt steps run.shard itself",
     "restore into the tensors the run holds (copy_, load_state_dict), not new ones"),
    ("shard", "the slice run.opt steps", "this rank's slice of the parameters"),
    ("params", "run.params", "every rank holds all the parameters: its slice and the others'"),
    ("losses", "run.losses", "the losses of the steps before the checkpoint"),
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))  # exact
    return type(a) is type(b) and a == b


def _said(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of {value.numel()}"
    if isinstance(value, list):
        return f"a list of {len(value)} entries"
    return repr(value)


def differs(got: Any, want: dict, when: str) -> str | None:
    """The first part of :data:`PARTS` where ``got`` is not bitwise ``want``, in words."""
    if not isinstance(got, dict):
        return f"{when}, the trial sent back {type(got).__name__}, not the run's state"
    for key, what, why in PARTS:
        mine, theirs = got.get(key), want[key]
        if _same(mine, theirs):
            continue
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) \
                and mine.shape == theirs.shape and mine.dtype == theirs.dtype \
                and key != "gen":
            off = (mine.double() - theirs.double()).abs().max().item()
            return (f"{when}, {what} differs from the run never interrupted by up to {off:.3g} "
                    f"({why})")
        if key in ("gen", "stepped_is_shard"):
            return f"{when}, {what} is not the run never interrupted's ({why})"
        return (f"{when}, {what} is {_said(mine)}, the run never interrupted's "
                f"{_said(theirs)} ({why})")
    return None


def _death(die_at: int | None, torn_rank: int | None) -> str:
    if torn_rank is None:
        return f"a rank killed during step {die_at}"
    return f"rank {torn_rank}'s disk full while it saved step {die_at}"


def _draw(p: int, how: str) -> tuple[list[list[int | None]], list[int]]:
    """The deaths of a check (``killed``, ``torn``, or ``twice``: killed, then torn), drawn
    afresh each time, and the step each job must resume from (the first: 0)."""
    draw, steps = random.Random(), resumable(p)

    def killed(k: int) -> list[int | None]:
        return [k + draw.randint(1, EVERY), None]

    def torn(k: int) -> list[int | None]:
        return [k + EVERY, draw.randrange(p)]

    if how == "twice":
        first, second = sorted(draw.sample(steps, 2))
        return [killed(first), torn(second)], [0, first, second]
    k = draw.choice(steps)
    return [killed(k) if how == "killed" else torn(k)], [0, k]


def _resume(mc: Any, p: int, which: int, how: str) -> str | None:
    deaths, expected = _draw(p, how)
    scenes = [", then ".join(_death(*d) for d in deaths[:j]) for j in range(len(deaths) + 1)]
    try:
        got = run(mc, resume_trial, SAVE, LOAD, which, deaths, ranks=p)
    except ExerciseError as exc:
        torn = [_death(*d) for d in deaths if d[1] is not None]
        if not torn:
            raise
        first, _, rest = str(exc).partition("\n")
        raise ExerciseError(f"after {scenes[-1]} (what it wrote cut short) and a restart, "
                            f"{first} (a checkpoint is complete, or ignored)"
                            + (rest and "\n" + rest)) from None
    ref = uninterrupted(CASES[which], p)
    for j, k in enumerate(expected[1:], 1):
        loads = [(out.get("loads", [])[j:j + 1] or [None])[0] for out in got]
        if len({repr(x) for x in loads}) > 1:
            return (f"after {scenes[j]}, load returned steps {loads} "
                    f"on ranks 0..{p - 1}: the ranks resumed from different checkpoints; the "
                    f"newest every rank completed is step {k}")

    def test(r: int, out: dict) -> str | None:
        for j, k in enumerate(expected):
            problem = _job(out, j, k, scenes[j], ref[r])
            if problem:
                return problem
        return differs(out.get("final"), ref[r][STEPS],
                       f"after {scenes[-1]}, load and training on to step {STEPS}")

    return per_rank(got, test)


def _job(out: dict, j: int, k: int, scene: str, ref: list[dict]) -> str | None:
    """What job ``j``'s load did wrong, resuming from step ``k`` after ``scene``."""
    loads, states = out.get("loads", []), out.get("states", [])
    if j >= len(loads):
        return f"after {scene}, the trial ended before load (a rank's error)"
    if j == 0:
        if loads[0] != 0:
            return f"load on an empty folder (a job's first start) returned {loads[0]!r}, not 0"
        problem = differs(states[0], ref[0], "after load on an empty folder")
        return problem and problem + " (with no checkpoint, load must leave the run as it is)"
    if loads[j] != k:
        return (f"after {scene}, load returned step {loads[j]!r}, but every rank's save of "
                f"step {k} had returned: a save that returns has saved, and load must find it")
    problem = differs(states[j], ref[k], f"after {scene} and load")
    if problem or "steps" not in out:
        return problem
    return (f"after {scene} and load, the ranks' run.step are {out['steps']}: every rank must "
            "resume from the same checkpoint")


CONTRACT = Contract(
    dtypes=tuple(c.dtype for c in CASES),
    shapes=tuple((c.n(),) for c in CASES),  # 117 and 187 parameters, which no p divides
    why_not={"aliasing": "the state is the run's own; aliasing is what the check of "
                         "'run.opt steps run.shard itself' looks at, and nothing else is shared",
             "groups": "load takes the world's communicator; " + NOT_YET,
             "orders": "the functions take no order of actions",
             "accumulation": "save and load take no gradients: the run steps between them"},
)

CHECKS = (
    Check("a rank killed: the restarted job resumes from the newest checkpoint, bit for bit "
          "the run never interrupted",
          lambda mc: at_sizes(mc, lambda p: _resume(mc, p, 0, "killed"))),
    Check("a disk full during a save: the torn checkpoint is ignored, the one before resumed, "
          "bit for bit the run never interrupted",
          lambda mc: at_sizes(mc, lambda p: _resume(mc, p, 1, "torn"))),
    Check("restarted twice (killed, then a disk full): each job resumes where the last one's "
          "newest complete checkpoint is, bit for bit the run never interrupted",
          lambda mc: at_sizes(mc, lambda p: _resume(mc, p, 0, "twice"))),
)
check = checker(CHECKS)
