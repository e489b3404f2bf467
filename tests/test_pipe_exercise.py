"""Exercise 10's references (pcourse.tools.grading.refs, "10 pipeline"), checked without MPI.

The 1F1B closed form against its defining properties and against a simulation of the
messages it sends; the one-process gradients against the solution's own loop run on
threads (a mailbox in place of MPI); and the plain-words diagnoses against the mistakes
they name. The exercise itself is graded in tests/test_grading.py (its solution and
wrong answers, on MPI engines).
"""

from __future__ import annotations

import threading
from pathlib import Path

import nbformat
import pytest
import torch

from pcourse.tools.grading.refs import orders as order_refs
from pcourse.tools.grading.refs import pipeline_schedule as refs

SOLUTION = Path(__file__).resolve().parents[1] / "solutions" / "10_pipeline_schedule.ipynb"
SIZES = [(p, m) for p in (2, 3, 4, 5) for m in range(1, 10)]


def blocked(orders: list[list[tuple[str, int]]]) -> list[int]:
    """The stages that never finish their orders when sends return at once and only
    receives wait (what PipeGroup gives): a simulation of the messages, no MPI."""
    p, at, sent = len(orders), [0] * len(orders), set()
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(orders[r]):
                action, i = orders[r][at[r]]
                source = r - 1 if action == "F" else r + 1
                if 0 <= source < p and (source, r, i) not in sent:
                    break  # waits in group.recv
                dest = r + 1 if action == "F" else r - 1
                if 0 <= dest < p:
                    sent.add((r, dest, i))
                at[r] += 1
                moved = True
    return [r for r in range(p) if at[r] < len(orders[r])]


@pytest.mark.parametrize("p,m", SIZES)
def test_the_closed_form_is_1f1b(p, m):
    for rank in range(p):
        order = refs.one_f_one_b_reference(p, rank, m)
        forwards = [i for a, i in order if a == "F"]
        backwards = [i for a, i in order if a == "B"]
        assert forwards == backwards == list(range(m))  # each once, in micro-batch order
        assert order_refs.in_flight(order) == min(p - rank, m)  # what 1F1B is for
        warm = min(p - rank - 1, m)
        assert order[:warm] == [("F", i) for i in range(warm)]
        steady = order[warm:warm + 2 * (m - warm)]
        assert [a for a, _ in steady] == ["F", "B"] * (m - warm)  # one forward, one backward
        assert order_refs.pipe_order_problem({"p": p, "rank": rank, "m": m, "order": order}) is None
    assert blocked([refs.one_f_one_b_reference(p, r, m) for r in range(p)]) == []


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_deadlock_check_s_orders_deadlock_every_stage(p):
    orders = [refs.pipe_deadlock_orders(p, r) for r in range(p)]
    assert blocked(orders) == list(range(p))
    assert blocked([refs.gpipe_order(2)] * p) == []  # GPipe runs: it only keeps more


def test_gpipe_is_named_and_an_off_by_one_warm_up_is_told_apart():
    def results(order_of):
        return [{"p": p, "rank": r, "m": m, "order": order_of(p, r, m)}
                for p in order_refs.PIPE_ORDER_SIZES for m in range(1, 9) for r in range(p)]

    assert order_refs.pipe_orders_problem(results(refs.one_f_one_b_reference)) is None
    gpipe = order_refs.pipe_orders_problem(results(lambda p, r, m: refs.gpipe_order(m)))
    assert "GPipe's order" in gpipe and "keeps 2 micro-batches" in gpipe

    def one_more(p, r, m):
        return refs.one_f_one_b_reference(p + 1, r, m)  # a warm-up of min(p - rank, m)

    late = order_refs.pipe_orders_problem(results(one_more))
    assert "GPipe" not in late and "a warm-up of min(p - rank - 1, m) = 0 forwards" in late


def test_orders_and_gradients_are_taken_as_the_cases_asked_for_not_as_labelled():
    """A result labelled as an easier case (m = 1), or cases left out, must not pass."""
    cases = order_refs.pipe_order_cases()
    easy = [{"p": p, "rank": r, "m": 1, "order": refs.one_f_one_b_reference(p, r, 1)}
            for p, r, _ in cases]  # every order m = 1's, each labelled m = 1
    said = order_refs.pipe_orders_problem(easy)
    assert said == "at p=2, m=2, stage 0: micro-batch 1 never goes forward"
    right = [{"p": p, "rank": r, "m": m, "order": refs.one_f_one_b_reference(p, r, m)}
             for p, r, m in cases]
    assert order_refs.pipe_orders_problem(right) is None
    assert "orders where" in order_refs.pipe_orders_problem(right[:-1])
    want = {m: refs.one_process_pipe(2, m) for m in refs.PIPE_MS}
    stage = [{"m": m, "grads": want[m]["grads"][0]} for m in refs.PIPE_MS]
    assert refs.pipe_stage_problem(stage, want, 0) is None
    assert "were asked for" in refs.pipe_stage_problem(stage[:1], want, 0)
    relabelled = [{"m": 1, "grads": want[1]["grads"][0]} for _ in refs.PIPE_MS]
    assert refs.pipe_stage_problem(relabelled, want, 0).startswith(f"m={refs.PIPE_MS[1]}: ")


# ---------------------------------------------------------------- the loop, on threads

class Mailbox:
    """PipeGroup's send and recv between threads: one stage per thread, no MPI."""

    def __init__(self) -> None:
        self.box: dict[tuple[int, int, int], torch.Tensor] = {}
        self.cond = threading.Condition()


class ThreadGroup:
    def __init__(self, mailbox: Mailbox, rank: int, size: int) -> None:
        self.mail, self.rank, self.size = mailbox, rank, size

    def send(self, tensor: torch.Tensor, dest: int, i: int) -> None:
        assert 0 <= dest < self.size and dest != self.rank
        with self.mail.cond:
            self.mail.box[self.rank, dest, i] = tensor.detach().clone()
            self.mail.cond.notify_all()

    def recv(self, source: int, i: int) -> torch.Tensor:
        with self.mail.cond:
            if not self.mail.cond.wait_for(lambda: (source, self.rank, i) in self.mail.box,
                                           timeout=10):
                raise TimeoutError(f"stage {self.rank} waited for {(source, i)}")
            return self.mail.box.pop((source, self.rank, i))


def solution_loop(*swaps: tuple[str, str]):
    """The solution notebook's run_stage (its exercise cells run here), with ``swaps``
    made in its source: a learner's mistake, without MPI."""
    cells = [c.source for c in nbformat.read(SOLUTION, as_version=4).cells
             if "exercise" in c.metadata.get("tags", [])]
    source = "\n".join(cells)
    for old, new in swaps:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch}
    exec(compile(source, str(SOLUTION), "exec"), namespace)  # the course's own
    return namespace["run_stage"]


def on_threads(stage_main, p: int, errors: list) -> None:
    """Run ``stage_main(rank)`` for every stage on a thread of its own, each joined with a
    deadline; what any raised fails the test."""
    threads = [threading.Thread(target=stage_main, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors


def threaded(run_stage, p: int, m: int) -> list[dict]:
    """Every stage's result with its m, as pipe_stage_problem hands it on; stages on threads."""
    mailbox, out, errors = Mailbox(), [None] * p, []
    stages = [refs.pipe_stage(p, r) for r in range(p)]  # here: they seed torch's global RNG

    def stage_main(rank: int) -> None:
        try:
            stage = stages[rank]
            run_stage(stage, refs.one_f_one_b_reference(p, rank, m),
                      ThreadGroup(mailbox, rank, p), *refs.pipe_data(m, p, rank), m)
            out[rank] = {"m": m, "grads": [t.grad for t in stage.parameters()]}
        except Exception as exc:  # noqa: BLE001 - reported below, for the test to fail
            errors.append(exc)

    on_threads(stage_main, p, errors)
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", refs.PIPE_MS)
def test_the_solution_s_stages_equal_one_process(p, m):
    want = refs.one_process_pipe(p, m)
    for rank, got in enumerate(threaded(solution_loop(), p, m)):
        assert refs.pipe_grads_problem(got, want, rank) is None


@pytest.mark.parametrize("swap,said", [
    (("/ m", "/ group.size"), "divided by the number of stages p"),
    (("/ m", ""), "not their mean"),
    (("x, y = kept.pop(i)", "x, y = kept.pop(i)\n            stage.zero_grad()"),
     "last micro-batch's gradient alone"),
    (("targets[i]", "targets[m - 1 - i]"), "is off by"),
])
def test_the_loops_mistakes_are_named(swap, said):
    p, m = 3, 4
    want = refs.one_process_pipe(p, m)
    got = threaded(solution_loop(swap), p, m)
    problems = [refs.pipe_grads_problem(o, want, r) for r, o in enumerate(got)]
    assert any(said in (problem or "") for problem in problems), problems


def test_inputs_and_targets_read_on_the_wrong_stage_say_where_they_are():
    inputs, targets = refs.pipe_data(2, 3, 1)
    assert not inputs and not targets
    with pytest.raises(LookupError, match="only stage 2 has the targets"):
        targets[0]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 5, 6, 7, 8])
def test_random_orders_are_valid_never_deadlock_and_leave_the_forwards_order(p, m):
    orders = refs.random_orders(p, m, seed=m)
    for order in orders:
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
    assert blocked(orders) == []
    assert any(order_refs.out_of_turn(order) for order in orders)  # what 1F1B and GPipe never do
    assert refs.random_orders(p, m, seed=m) == orders  # every rank draws the same


def test_every_case_s_orders_never_deadlock():
    for case in refs.stage_cases():
        for p in (2, 3, 4):
            assert blocked(case.orders(p)) == []


def threaded_case(run_stage, p: int, case) -> list[dict]:
    """Every stage's result in one of the loop's cases (its orders, dtype, shape, gradients
    already there), as pipe_cases_trial sends it back; stages on threads."""
    mailbox, out, errors = Mailbox(), [None] * p, []
    stages = [refs.pipe_stage(p, r, case) for r in range(p)]
    for r, stage in enumerate(stages):
        for t, old in zip(stage.parameters(), refs.old_grads(case, p, r) if case.accumulate
                          else [], strict=False):
            t.grad = old
    batch = refs.pipe_batch(case.m, case)
    inputs, targets = (list(t.split(case.shape[0])) for t in batch)

    def stage_main(rank: int) -> None:
        try:
            run_stage(stages[rank], case.orders(p)[rank], ThreadGroup(mailbox, rank, p),
                      inputs, targets, case.m)
            out[rank] = {"grads": [t.grad for t in stages[rank].parameters()], "changed": False}
        except Exception as exc:  # noqa: BLE001 - reported below, for the test to fail
            errors.append(exc)

    on_threads(stage_main, p, errors)
    return out


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("k", range(len(refs.stage_cases())))
def test_the_solution_passes_every_case_and_a_queue_of_forwards_does_not(p, k):
    case = refs.stage_cases()[k]
    want = refs.one_process_pipe(p, case.m, case)
    for rank, got in enumerate(threaded_case(solution_loop(), p, case)):
        assert refs.stage_case_problem(got, case, want, rank) is None
    queue = solution_loop(("kept = {}", "kept = []"), ("kept[i] = (x, y)", "kept.append((x, y))"),
                          ("x, y = kept.pop(i)", "x, y = kept.pop(0)"))
    said = [refs.stage_case_problem(o, case, want, r)
            for r, o in enumerate(threaded_case(queue, p, case))]
    if case.order == "random":
        assert any("pair each ('B', i)" in (s or "") for s in said), said
    else:
        assert said == [None] * p  # 1F1B and GPipe run the backwards in the forwards' order
