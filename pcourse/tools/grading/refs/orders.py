"""Exercise 10's orders: 1F1B's closed form (:func:`one_f_one_b_reference`), GPipe's,
random valid orders drawn from a run of the whole pipeline (:func:`random_orders`), and the
learner's ``one_f_one_b`` tried at every p, stage and m and read in plain words
(:func:`pipe_orders_problem`). The loop's checks are :mod:`.pipeline_schedule`'s."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

PIPE_ORDER_SIZES = (2, 3, 4)  # the order is plain Python: checked at every size, grader or not


@functools.lru_cache(maxsize=64)
def random_orders(p: int, m: int, seed: int) -> list[list[tuple[str, int]]]:
    """Every stage's order, drawn from one random run of the whole pipeline: each step one
    action whose inputs are there (("F", i) on stage r after it on r - 1; ("B", i) on r after
    ("F", i) on r and ("B", i) on r + 1). So each stage runs a micro-batch's forward before
    its backward, and, with sends that return at once, no stage waits forever. Drawn again
    until some stage runs its backwards in another order than its forwards (which 1F1B and
    GPipe never do)."""
    rng = random.Random(seed)
    while True:
        done: set[tuple[int, str, int]] = set()
        orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]
        while len(done) < 2 * m * p:
            r, a, i = rng.choice([(r, a, i) for r in range(p) for i in range(m) for a in "FB"
                                  if (r, a, i) not in done and _ready(r, a, i, p, done)])
            done.add((r, a, i))
            orders[r].append((a, i))
        if any(out_of_turn(order) for order in orders):
            return orders


def _ready(r: int, a: str, i: int, p: int, done: set) -> bool:
    if a == "F":
        return r == 0 or (r - 1, "F", i) in done
    return (r, "F", i) in done and (r == p - 1 or (r + 1, "B", i) in done)


def out_of_turn(order: list[tuple[str, int]]) -> bool:
    """Does a stage run its backwards in another order than its forwards?"""
    return [i for a, i in order if a == "B"] != [i for a, i in order if a == "F"]


def one_f_one_b_reference(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    """Stage ``rank`` of ``p``'s 1F1B order over ``m`` micro-batches, from the closed form.

    A warm-up of min(p - rank - 1, m) forwards (the later stages have not yet sent a
    gradient back), then one forward and one backward in turn, then the backwards left.
    """
    warm = min(p - rank - 1, m)
    order = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", i) for i in range(m - warm, m)]


def gpipe_order(m: int) -> list[tuple[str, int]]:
    """GPipe's order: every forward, then every backward (the same on every stage)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once: the activations
    a stage must keep."""
    now = peak = 0
    for action, _ in order:
        now += 1 if action == "F" else -1
        peak = max(peak, now)
    return peak


def pipe_order_cases() -> list[tuple[int, int, int]]:
    """(p, rank, m) of every order :func:`pipe_order_trial` asks for, in its order."""
    return [(p, rank, m) for p in PIPE_ORDER_SIZES for m in range(1, 9) for rank in range(p)]


def pipe_order_trial(one_f_one_b: Callable) -> list[dict]:
    """The learner's order of every stage at p = 2, 3, 4 and m = 1..8 (plain Python), in
    the order of :func:`pipe_order_cases`: the checks know which case each answers."""
    return [{"order": plain_order(one_f_one_b(p, rank, m))}
            for p, rank, m in pipe_order_cases()]


def plain_order(order: Any) -> list[tuple[str, int]]:
    """``order`` as a list of (str, int), or a TypeError that says what it was instead."""
    if not isinstance(order, list | tuple):
        raise TypeError(f"one_f_one_b returned {type(order).__name__}, not a list of "
                        "(action, micro-batch) pairs such as [('F', 0), ('B', 0)]")
    plain = []
    for k, step in enumerate(order):
        if not (isinstance(step, tuple | list) and len(step) == 2):
            raise TypeError(f"one_f_one_b's step {k} is {step!r}, not a pair such as ('F', 0)")
        plain.append((str(step[0]), int(step[1])))
    return plain


def pipe_order_problem(got: dict) -> str | None:
    """What is wrong with one stage's order, in plain words; None if nothing."""
    p, rank, m, order = got["p"], got["rank"], got["m"], [tuple(s) for s in got["order"]]
    where = f"at p={p}, m={m}, stage {rank}: "
    seen: dict[tuple[str, int], int] = {}
    for k, (action, i) in enumerate(order):
        if action not in ("F", "B") or not 0 <= i < m:
            return (where + f"step {k} is {(action, i)}: an action is 'F' or 'B' and a "
                    f"micro-batch 0 to {m - 1}")
        if (action, i) in seen:
            return where + f"micro-batch {i} goes {_way(action)} twice (steps {seen[action, i]} " \
                f"and {k})"
        if action == "B" and ("F", i) not in seen:
            return where + f"micro-batch {i} goes backward (step {k}) before it went forward"
        seen[action, i] = k
    missing = [(a, i) for i in range(m) for a in ("F", "B") if (a, i) not in seen]
    if missing:
        return where + f"micro-batch {missing[0][1]} never goes {_way(missing[0][0])}"
    want = one_f_one_b_reference(p, rank, m)
    if order == want:
        return None
    most, limit = in_flight(order), min(p - rank, m)
    kept = (f"it keeps up to {most} micro-batches' activations in flight where 1F1B keeps at "
            f"most min(p - rank, m) = {limit}")
    ahead, right = _ahead(order), _ahead(want)
    if ahead != right:
        extra = f"; {kept}" if most > limit else ""
        return (where + f"it runs {_forwards(ahead)} before its first backward, 1F1B "
                f"{right}: a warm-up of min(p - rank - 1, m) = {_forwards(min(p - rank - 1, m))}, "
                f"then one forward before each backward{extra}")
    k = next(k for k, (a, b) in enumerate(zip(order, want, strict=True)) if a != b)
    return (where + f"step {k} is {order[k]}, 1F1B's is {want[k]}: after the warm-up, one "
            "forward and one backward in turn, then the remaining backwards, each in "
            "micro-batch order")


def pipe_orders_problem(results: list[dict]) -> str | None:
    """The first stage, size and m whose order is wrong, in plain words; None if none.

    An order that is GPipe's everywhere is said to be, at the first place it differs from
    1F1B's: its gradients are right, only the count in flight shows it. Each order is
    taken as the case asked for in its place (:func:`pipe_order_cases`), whatever the
    rank labelled it.
    """
    cases = pipe_order_cases()
    if len(results) != len(cases):
        return (f"the rank sent back {len(results)} orders where {len(cases)} were asked "
                "for: did the code replace the checks' functions?")
    results = [{"p": p, "rank": rank, "m": m, "order": r["order"]}
               for (p, rank, m), r in zip(cases, results, strict=True)]
    if all([tuple(s) for s in r["order"]] == gpipe_order(r["m"]) for r in results):
        for r in results:
            want = one_f_one_b_reference(r["p"], r["rank"], r["m"])
            if want != gpipe_order(r["m"]):
                return (f"at p={r['p']}, m={r['m']}, stage {r['rank']}: this is GPipe's order "
                        "(every forward, then every backward): the gradients come out right, "
                        f"but it keeps {r['m']} micro-batches' activations in flight where 1F1B "
                        f"keeps at most min(p - rank, m) = {in_flight(want)}")
    return next(filter(None, map(pipe_order_problem, results)), None)


def _way(action: str) -> str:
    return "forward" if action == "F" else "backward"


def _forwards(n: int) -> str:
    return f"{n} forward" + ("" if n == 1 else "s")


def _ahead(order: list[tuple[str, int]]) -> int:
    """How many forwards an order runs before its first backward."""
    return next((k for k, (a, _) in enumerate(order) if a == "B"), len(order))
