"""Exercise 10, a pipeline schedule: ``one_f_one_b`` (1F1B's order) and ``run_stage``.

The order is plain Python, checked against the closed form (:func:`one_f_one_b_reference`)
at every p, stage and m; the loop runs a chain of blocks cut into stages, its messages
between stages through :class:`PipeGroup` (sends that return at once, receives with a
deadline), against one process's gradients (:func:`one_process_pipe`). The loop's cases
are drawn from :data:`CONTRACT` (:func:`stage_cases`): 1F1B's order, GPipe's, and random
valid ones (:func:`random_orders`), in each dtype, in other shapes, with gradients already
there, on two communicators in turn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pcourse.tools.grading.checks import (
    Check,
    Contract,
    ExerciseError,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
    sizes,
    tensors_differ,
)
from pcourse.tools.grading.refs.common import case_error, each_case
from pcourse.tools.grading.refs.orders import (
    gpipe_order,
    one_f_one_b_reference,
    pipe_order_trial,
    pipe_orders_problem,
    plain_order,
    random_orders,
)
from pcourse.tools.grading.trials import world

ORDER, STAGE = Learner("one_f_one_b"), Learner("run_stage")


PIPE_WIDTH, PIPE_MICRO = 4, 2  # the model's width; rows of one micro-batch
PIPE_LAYERS = 2  # Linear + tanh blocks per stage: the stages of p = 2, 3, 4 cut one chain
PIPE_MS = (1, 3, 4, 8)  # micro-batch counts of the loop's checks: m < p, m not a multiple of p

CONTRACT = Contract(
    dtypes=(torch.float64, torch.float32, torch.bfloat16),  # the stage's; messages carry it
    shapes=((3, 5), (1, 6)),  # a micro-batch's (rows, width) beyond the text's [2, 4]
    layouts=("the inputs and targets: views of one batch, as a caller's split gives them",),
    aliasing=("the inputs and targets: views of the caller's batch, compared after",),
    groups=2,  # the cases alternate two communicators, each its own group: a loop that keeps
    #            a group from an earlier call sends where no one receives
    orders=("1F1B", "GPipe (m > p in flight)",
            "random valid: each stage's forward of a micro-batch before its backward, drawn "
            "from one random run of the whole pipeline, so no stage waits on a message sent "
            "only after its own wait (random_orders)"),
    accumulation=True,  # gradients already there before run_stage, added to
)


@dataclass(frozen=True)
class StageCase:
    """One case of the loop: its order ("1F1B", "GPipe" or "random"), m, the stage's dtype,
    a micro-batch's (rows, width), and whether gradients are already there."""

    order: str
    m: int
    dtype: torch.dtype = torch.float64
    shape: tuple[int, int] = (2, 4)
    accumulate: bool = False

    def said(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        order = {"1F1B": "1F1B's order", "GPipe": f"GPipe's order ({self.m} micro-batches in "
                 "flight)", "random": "a random valid order"}[self.order]
        grads = ", gradients already there" if self.accumulate else ""
        return f"with {order}, m={self.m}, {dtype} micro-batches of {self.shape}{grads}"

    def orders(self, p: int) -> list[list[tuple[str, int]]]:
        """Every stage's order in this case."""
        if self.order == "random":
            return random_orders(p, self.m, seed=self.m)
        if self.order == "GPipe":
            return [gpipe_order(self.m)] * p
        return [one_f_one_b_reference(p, r, self.m) for r in range(p)]


def stage_cases() -> list[StageCase]:
    """The loop's cases, drawn from :data:`CONTRACT`: the text's (1F1B, float64, [2, 4]) at
    m = 1 and at m < p, GPipe's with more in flight than stages, random valid orders; each
    dtype and shape, gradients already there in most (not bfloat16's: its rounding of
    them would hide a stage's own, smaller gradients)."""
    (a, b), dt = CONTRACT.shapes, CONTRACT.dtypes
    assert len(a) == len(b) == 2  # (rows, width) each
    return [StageCase("1F1B", 1), StageCase("1F1B", 4, dt[1], a),
            StageCase("GPipe", 8, accumulate=True), StageCase("random", 5, dt[0], b, True),
            StageCase("random", 6, dt[2]), StageCase("random", 7, dt[1], a, True)]


TEXT = StageCase("1F1B", 1)  # the text's dtype and shape (m aside)


def pipe_block(k: int, case: StageCase = TEXT) -> torch.nn.Module:
    """Block ``k`` of the chain (Linear + tanh, in the case's dtype and width), seeded by its
    place in it."""
    torch.manual_seed(1000 + k)
    width = case.shape[1]
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()).double().to(
        case.dtype)


def pipe_stage(p: int, rank: int, case: StageCase = TEXT) -> torch.nn.Module:
    """Stage ``rank`` of ``p``: blocks PIPE_LAYERS·rank onwards of the chain."""
    return torch.nn.Sequential(*(pipe_block(rank * PIPE_LAYERS + j, case)
                                 for j in range(PIPE_LAYERS)))


def pipe_batch(m: int, case: StageCase = TEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of m micro-batches, and the weights the loss sums the output with.

    The weights differ at every position, so a micro-batch's output paired with another
    one's weights, or transposed, changes the gradients.
    """
    seed = 500 + m if case.shape == TEXT.shape else 600 + m + 10 * case.shape[1]
    gen = torch.Generator().manual_seed(seed)
    shape = (m * case.shape[0], case.shape[1])
    return (torch.randn(shape, generator=gen, dtype=torch.float64).to(case.dtype),
            torch.randn(shape, generator=gen, dtype=torch.float64).to(case.dtype))


def _micro(t: torch.Tensor, m: int, rows: int = PIPE_MICRO) -> list[torch.Tensor]:
    """The micro-batches: views of the caller's batch (the checks compare it after)."""
    return list(t.split(rows))[:m]


class NotHere:
    """What a stage gets in place of the inputs or targets another stage holds: reading it
    says which stage has them (where None would only say it is not subscriptable)."""

    def __init__(self, what: str, holder: int, rank: int) -> None:
        self.what, self.holder, self.rank = what, holder, rank

    def __getitem__(self, i: Any) -> Any:
        raise LookupError(f"stage {self.rank} read {self.what}[{i!r}], but only stage "
                          f"{self.holder} has the {self.what}: the first stage (rank 0) the "
                          "inputs, the last (rank p - 1) the targets")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<no {self.what} on stage {self.rank}>"


def pipe_data(m: int, p: int, rank: int, case: StageCase = TEXT) -> tuple[Any, Any]:
    """Stage ``rank``'s inputs (the first stage's) and targets (the last's), m micro-batches."""
    x, weights = pipe_batch(m, case)
    return (_micro(x, m, case.shape[0]) if rank == 0 else NotHere("inputs", 0, rank),
            _micro(weights, m, case.shape[0]) if rank == p - 1 else
            NotHere("targets", p - 1, rank))


PIPE_TAG_BASE = 3000  # above the small tags other exercises' messages carry


class PipeGroup:
    """The point-to-point messages between stages, as the exercise's ``group`` gives them.

    ``send`` posts MPI's Isend of a float64 copy and returns at once (the trial waits for
    every send after the learner's loop, with a deadline); ``recv`` waits for a message
    polling MPI's Irecv, and past the deadline raises DeadlockError saying who waited for
    what. The micro-batch number, after ``base``, is the message's tag: a message cannot be
    taken for another micro-batch's, nor for one of another m run on the same communicator.
    """

    def __init__(self, comm: Any, timeout: float, m: int, base: int = 0,
                 case: StageCase = TEXT) -> None:
        self.comm, self.timeout, self.m, self.base = comm, timeout, m, base
        self.shape, self.dtype = case.shape, case.dtype
        self.rank, self.size = comm.rank, comm.size
        self.pending: list[tuple[Any, np.ndarray, str]] = []  # requests, buffers they keep

    def _tag(self, i: Any) -> int:
        if not isinstance(i, int | np.integer) or not 0 <= i < self.m:
            raise ValueError(f"stage {self.rank} sent or received micro-batch {i!r}: there are "
                             f"m = {self.m}, numbered 0 to {self.m - 1}")
        return self.base + int(i)

    def _peer(self, peer: Any, what: str) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.size \
                or peer == self.rank:
            raise ValueError(
                f"stage {self.rank} {what} rank {peer!r}: a pipeline of {self.size} stages has "
                f"ranks 0 to {self.size - 1}. Activations go forward to rank + 1 and gradients "
                "back to rank - 1; the first stage receives no activation and the last sends "
                "none forward")
        return int(peer)

    def send(self, tensor: torch.Tensor, dest: int, i: int) -> None:
        """Post the send of micro-batch ``i``'s tensor to rank ``dest``; return at once."""
        dest = self._peer(dest, "sent to")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"group.send needs a tensor, got {type(tensor).__name__} (a "
                            "received activation needs requires_grad_() before the forward, "
                            "or its .grad stays None)")
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"group.send got a tensor of shape {tuple(tensor.shape)}; every "
                             f"message here is one micro-batch, {self.shape}")
        tag = self._tag(i)
        buf = np.ascontiguousarray(tensor.detach().double().numpy()).copy()  # exact for
        #                                                   float32 and bfloat16 numbers too
        what = f"micro-batch {int(i)}'s tensor from stage {self.rank} to stage {dest}"
        self.pending.append((self.comm.Isend(buf, dest, tag), buf, what))

    def recv(self, source: int, i: int) -> torch.Tensor:
        """Wait for micro-batch ``i``'s tensor from rank ``source``; a new tensor of the
        stage's dtype."""
        from pcourse.runtime.waits import CollectiveTimeout, wait_request
        from pcourse.tools.grading.trials import DeadlockError

        source = self._peer(source, "received from")
        buf = np.empty(self.shape)
        request = self.comm.Irecv(buf, source, self._tag(i))
        try:
            wait_request(request, self.timeout)
        except CollectiveTimeout:
            request.Cancel()  # withdrawn: no late message lands in it
            raise DeadlockError(
                f"stage {self.rank} waited {self.timeout:g} s for micro-batch {int(i)}'s tensor "
                f"from stage {source} (group.recv({source}, {int(i)})) and it never came: a "
                f"deadlock. Stage {source} sends it only after something it waits for itself; "
                "with sends that return at once, only receives wait, so follow the order: a "
                "forward receives from rank - 1 (the first stage takes its input), a backward "
                "from rank + 1 (the last stage starts from its loss)") from None
        return torch.from_numpy(buf).to(self.dtype)

    def finish(self) -> None:
        """Wait for every send posted: each must have been received, within the deadline."""
        from pcourse.runtime.waits import CollectiveTimeout, wait_request
        from pcourse.tools.grading.trials import DeadlockError

        for request, _, what in self.pending:
            try:
                wait_request(request, self.timeout)
            except CollectiveTimeout:
                raise DeadlockError(f"{what} was never received within {self.timeout:g} s: "
                                    "does that stage receive it, from this rank, with this "
                                    "micro-batch number?") from None
        self.pending.clear()


def pipe_stage_trial(run_stage: Callable, one_f_one_b: Callable | None,
                     ms: tuple[int, ...] = PIPE_MS) -> list[dict]:
    """This stage's gradients after the learner's ``run_stage`` for each m: with the
    reference 1F1B order, or, given ``one_f_one_b``, with the learner's own."""
    from pcourse.tools.grading.trials import OP_TIMEOUT

    # A communicator of its own, never freed: a run that fails leaves sends unreceived, and a
    # freed communicator's context is reused, so they would meet a later learner's receives
    # (seen grading a class: another learner's wrong loop's tensors). Each m its own tags.
    comm = world().Dup()
    p, rank = comm.size, comm.rank
    out = []
    for k, m in enumerate(ms):
        group = PipeGroup(comm, OP_TIMEOUT, m, base=PIPE_TAG_BASE + k * max(ms))
        stage = pipe_stage(p, rank)
        order = (one_f_one_b_reference(p, rank, m) if one_f_one_b is None
                 else plain_order(one_f_one_b(p, rank, m)))
        run_stage(stage, order, group, *pipe_data(m, p, rank), m)
        group.finish()
        out.append({"grads": [None if t.grad is None else t.grad.detach().clone()
                              for t in stage.parameters()]})  # its m: its place in ms
    return out


def old_grads(case: StageCase, p: int, rank: int) -> list[torch.Tensor]:
    """The gradients stage ``rank`` holds before run_stage, where its case has some."""
    gen = torch.Generator().manual_seed(800 + rank + 10 * p)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(case.dtype)
            for t in pipe_stage(p, rank, case).parameters()]


def pipe_cases_trial(run_stage: Callable) -> list[dict]:
    """This stage's gradients after the learner's ``run_stage`` in each case of
    :func:`stage_cases`, on two communicators in turn (each case its own group), and
    whether the caller's batch changed; the first case that raises ends the list."""
    comms = [world().Dup(), world().Dup()]  # never freed: see pipe_stage_trial
    return each_case(lambda k: _stage_case(run_stage, comms[k % 2], stage_cases()[k], k),
                     list(range(len(stage_cases()))))


def _stage_case(run_stage: Callable, comm: Any, case: StageCase, k: int) -> dict:
    from pcourse.tools.grading.trials import OP_TIMEOUT

    p, rank = comm.size, comm.rank
    group = PipeGroup(comm, OP_TIMEOUT, case.m, base=PIPE_TAG_BASE + 100 * (k + 1), case=case)
    stage = pipe_stage(p, rank, case)
    for t, old in zip(stage.parameters(), old_grads(case, p, rank) if case.accumulate else [],
                      strict=False):
        t.grad = old
    batch = pipe_batch(case.m, case)
    kept = [t.clone() for t in batch]
    inputs, targets = (_micro(t, case.m, case.shape[0]) for t in batch)
    run_stage(stage, case.orders(p)[rank], group,
              inputs if rank == 0 else NotHere("inputs", 0, rank),
              targets if rank == p - 1 else NotHere("targets", p - 1, rank), case.m)
    group.finish()
    return {"grads": [None if t.grad is None else t.grad.detach().clone()
                      for t in stage.parameters()],
            "changed": any(not torch.equal(a, b) for a, b in zip(batch, kept, strict=True))}


def pipe_deadlock_orders(p: int, rank: int) -> list[tuple[str, int]]:
    """Orders of m = 2 that wait on each other: every stage takes micro-batch 0 through
    and back before micro-batch 1, but the last takes micro-batch 1 first. Its first
    receive (micro-batch 1's activation) is sent only after stage p - 2's backward of
    micro-batch 0, which waits for the last stage: every stage ends up in a receive."""
    if rank == p - 1:
        return [("F", 1), ("B", 1), ("F", 0), ("B", 0)]
    return [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


PIPE_DEADLOCK_TIMEOUT = 2.0  # seconds: the check expects a deadlock, so it waits less


def pipe_deadlock_trial(run_stage: Callable) -> dict:
    """The learner's loop on :func:`pipe_deadlock_orders`: the DeadlockError's words if it
    reported one, else that it finished (it cannot have followed the order)."""
    from pcourse.tools.grading.trials import DeadlockError

    comm = world()
    p, rank, m = comm.size, comm.rank, 2
    # A communicator of its own, never freed: the deadlock leaves a message unreceived,
    # which must not meet a later communicator that reuses the world's context.
    group = PipeGroup(comm.Dup(), PIPE_DEADLOCK_TIMEOUT, m, base=PIPE_TAG_BASE)
    try:
        run_stage(pipe_stage(p, rank), pipe_deadlock_orders(p, rank), group,
                  *pipe_data(m, p, rank), m)
        group.finish()
    except DeadlockError as exc:
        return {"deadlock": str(exc)}
    return {"deadlock": None}


def pipe_deadlock_problem(got: dict) -> str | None:
    if got["deadlock"] is None:
        return ("it finished an order that cannot finish (the last stage takes micro-batch 1 "
                "first, the others micro-batch 0): run_stage must follow the order it is given, "
                "and let group.recv's DeadlockError through")
    if "deadlock" not in got["deadlock"]:
        return f"the deadlock was reported as {got['deadlock']!r}, without saying so"
    return None


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None  # every parameter of the chain takes part in the loss
    return t.grad.clone()


@functools.lru_cache(maxsize=64)
def one_process_pipe(p: int, m: int, case: StageCase | None = None) -> dict:
    """One process, the whole chain of p stages, on the whole batch of m micro-batches, in
    float64 of the case's rounded numbers.

    The loss is the mean over micro-batches of each one's weighted sum. Also returned:
    the gradients of micro-batch m - 1 alone (what a loop that does not accumulate
    keeps), those of the loss divided by p instead of m, the gradients already there
    (``old``, zeros where none) and each stage's tolerance, its dtype's relative to the
    stage's own gradients (``tol``).
    """
    case = case or TEXT
    x, weights = (t.double() for t in pipe_batch(m, case))
    stages = [pipe_stage(p, r, case).double() for r in range(p)]
    model = torch.nn.Sequential(*stages)
    (model(x) * weights).sum().div(m).backward()
    whole = [[_grad(t) for t in s.parameters()] for s in stages]
    model.zero_grad()
    rows = case.shape[0]
    (model(x[-rows:]) * weights[-rows:]).sum().div(m).backward()
    last = [[_grad(t) for t in s.parameters()] for s in stages]
    old = [[g.double() for g in old_grads(case, p, r)] if case.accumulate else
           [torch.zeros_like(g) for g in whole[r]] for r in range(p)]
    rtol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 6e-2}[case.dtype]
    tol = [(rtol, rtol * (1.0 if case.dtype == torch.float64 else
                          max(g.abs().max().item() for g in stage))) for stage in whole]
    return {"grads": whole, "last": last, "old": old, "tol": tol,
            "accumulate": case.accumulate,
            "by_p": [[g * m / p for g in stage] for stage in whole]}


PIPE_NAMES = [f"block {j}'s {what}" for j in range(PIPE_LAYERS) for what in ("weight", "bias")]


def pipe_stage_problem(got: list[dict], want: dict[int, dict], rank: int) -> str | None:
    """The first m (:data:`PIPE_MS`, in order, as asked) whose gradients are wrong on this
    stage; ``want``: one process's run for each m (:func:`one_process_pipe`)."""
    if len(got) != len(PIPE_MS):
        return (f"{len(got)} results where {len(PIPE_MS)} were asked for (m = "
                f"{', '.join(map(str, PIPE_MS))}): did the code replace the checks' functions?")
    return next(filter(None, (pipe_grads_problem({**one, "m": m}, want[m], rank)
                              for m, one in zip(PIPE_MS, got, strict=True))), None)


def pipe_grads_problem(got: dict, want: dict, rank: int) -> str | None:
    """What is wrong with one stage's gradients for one m, in plain words; None if nothing."""
    m, names = got["m"], [f"the gradient of {n}" for n in PIPE_NAMES]
    mine, old = got["grads"], want.get("old", [[0] * len(PIPE_NAMES)] * (rank + 1))[rank]
    rtol, atol = want["tol"][rank] if "tol" in want else (1e-12, 1e-12)
    if any(g is None for g in mine) or (want.get("accumulate") and all(
            torch.equal(g.double(), o) for g, o in zip(mine, old, strict=True))):
        return (f"m={m}: no gradient reached this stage's parameters: did the backward run "
                "(torch.autograd.backward(output, gradient)) on the stage's own output?")

    def plus(grads: list) -> list:
        return [g + o for g, o in zip(grads, old, strict=True)]

    problem = tensors_differ(mine, plus(want["grads"][rank]), names, rtol=rtol, atol=atol)
    if problem is None:
        return None

    def same(other: list) -> bool:
        return tensors_differ(mine, other, rtol=rtol, atol=atol) is None

    if want.get("accumulate") and same(want["grads"][rank]):
        return (f"m={m}: {problem}: the gradients the stage held before run_stage were lost "
                "(zeroed or replaced): a caller that accumulates over steps (gradient "
                "accumulation, lesson 12's 3D mesh) keeps them; add to .grad, never zero it")
    if m > 1 and same(want["last"][rank]):
        return (f"m={m}: {problem}: it is the last micro-batch's gradient alone; the "
                "micro-batches' gradients must add up (backward adds into .grad: do not zero "
                "or replace it between micro-batches)")
    if same(plus(want["by_p"][rank])):
        return (f"m={m}: {problem}: the loss was divided by the number of stages p; the mean "
                f"is over the m = {m} micro-batches")
    if m > 1 and same(plus([g * m for g in want["grads"][rank]])):
        return (f"m={m}: {problem}: it is the sum of the micro-batches' losses, not their mean: "
                "divide each one's loss by m")
    return f"m={m}: {problem}"


def _orders(mc: Any) -> str | None:
    """Plain Python: one rank tries every p, stage and m."""
    try:
        got = run(mc, pipe_order_trial, ORDER, ranks=1)[0]
    except ExerciseError as exc:
        return str(exc)
    return pipe_orders_problem(got)


def _stages(mc: Any, p: int, mine: Learner | None = None) -> str | None:
    want = {m: one_process_pipe(p, m) for m in PIPE_MS}
    got = run(mc, pipe_stage_trial, STAGE, mine, ranks=p)
    return per_rank(got, lambda r, o: pipe_stage_problem(o, want, r))


def _cases(mc: Any, p: int) -> str | None:
    got = run(mc, pipe_cases_trial, STAGE, ranks=p)
    cases = stage_cases()

    def test(rank: int, results: list[dict]) -> str | None:
        for at, (one, case) in enumerate(zip(results, cases, strict=False)):
            if "error" in one:
                hint = (": a stage keeps every micro-batch forwarded and not yet backwarded "
                        "(all m of them under GPipe)") if case.order == "GPipe" else ""
                raise ExerciseError(f"at {p} ranks, " + case_error(got, at, case.said()) + hint)
            problem = stage_case_problem(one, case, one_process_pipe(p, case.m, case), rank)
            if problem:
                return problem
        return None

    return per_rank(got, test)


def stage_case_problem(got: dict, case: StageCase, want: dict, rank: int) -> str | None:
    """What is wrong with one stage's run of one case, in plain words; None if nothing."""
    if got["changed"]:
        return (f"{case.said()}: run_stage changed the caller's inputs or targets (views of "
                "its batch) in place: leave them as given")
    problem = pipe_grads_problem({**got, "m": case.m}, want, rank)
    if problem and case.order == "random" and "lost" not in problem:
        problem += ("; this order runs some stage's backwards in another order than its "
                    "forwards (1F1B's and GPipe's orders, which passed, never do): pair each "
                    "('B', i) with micro-batch i's own forward, kept by its number")
    return f"{case.said()}: {problem.removeprefix(f'm={case.m}: ')}" if problem else None


def _deadlock(mc: Any, p: int) -> str | None:
    return per_rank(run(mc, pipe_deadlock_trial, STAGE, ranks=p),
                    lambda r, o: pipe_deadlock_problem(o))


CHECKS = (
    Check("the 1F1B order of every stage at p = 2, 3, 4 and m = 1 to 8, min(p - rank, m) in "
          "flight", _orders),
    Check("run_stage with any valid order (1F1B's, GPipe's, random ones), each dtype and "
          "shape, gradients already there: each stage's gradients equal one process's",
          lambda mc: at_sizes(mc, lambda p: _cases(mc, p))),
    Check("run_stage with your one_f_one_b's order: the same gradients",
          lambda mc: at_sizes(mc, lambda p: _stages(mc, p, ORDER))),
    # at the smallest and the largest size only: each waits out the deadline, and the
    # deadlock's shape (the last stage reversed, the middle ones waiting) is the same at any p
    Check("an order that cannot finish is reported as a deadlock within the deadline, not a "
          "hang", lambda mc: at_sizes(mc, lambda p: _deadlock(mc, p),
                                      only=(sizes(mc)[0], sizes(mc)[-1]))),
)
check = checker(CHECKS)
