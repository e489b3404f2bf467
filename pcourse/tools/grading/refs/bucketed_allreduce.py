"""Exercise 06, one bucket, one allreduce: ``allreduce_bucketed(model, comm)``.

The reference is one process on the whole batch (:func:`~.common.single_process_sgd`), two
SGD steps; the calls are the rank's record: exactly one ``Allreduce`` a step, carrying
every gradient number (none of a frozen or unused parameter).
"""

from __future__ import annotations

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
    differ,
    gradient_trial,
    make_model,
    names,
    single_process_sgd,
)
from pcourse.tools.grading.trials import Call

BUCKETED = Learner("allreduce_bucketed")
TOTAL = sum(p.numel() for p in make_model().parameters())


def _one_allreduce(calls: list[Call], numbers: int | None = None) -> str | None:
    if [c.name for c in calls] != ["Allreduce"]:
        return (f"it made {len(calls)} calls ({', '.join(c.name for c in calls) or 'none'}); "
                "expected one Allreduce")
    if numbers is not None and calls[0].count != numbers:
        return f"the Allreduce carried {calls[0].count} numbers; the model has {numbers} gradients"
    return None


def _one_message(mc: Any, p: int) -> str | None:
    got = run(mc, gradient_trial, BUCKETED, steps=2, ranks=p)
    return per_rank(got, lambda r, o: _one_allreduce(o["calls"][0], TOTAL)
                    or _one_allreduce(o["calls"][1], TOTAL))


def _after(mc: Any, p: int, steps: int) -> str | None:
    want = single_process_sgd(steps=2)  # one process, the whole batch
    got = run(mc, gradient_trial, BUCKETED, steps=2, ranks=p)
    return per_rank(got, lambda r, o: next(filter(None, [
        differ(o["grads"][s], want["grads"][s], names()) for s in range(steps)]
        + [differ(o["params"], want["params"], names()) if steps == 2 else None]), None))


def _skips_missing(mc: Any, p: int) -> str | None:
    # a frozen bias and an unused layer end backward with grad None: leave them out
    want = single_process_sgd(frozen=True)["grads"][0]
    got = run(mc, gradient_trial, BUCKETED, frozen=True, ranks=p)
    return per_rank(got, lambda r, o: _one_allreduce(o["calls"][0])
                    or differ(o["grads"][0], want, names(frozen=True)))


CONTRACT = Contract(
    dtypes=(torch.float64,),
    layouts=("a weight stored transposed", "a frozen parameter and an unused one"),
    aliasing=("the gradients: the same tensors after the call, one bucket between",),
    why_not={"dtypes": NOT_YET + " (float64, where a float32 bucket shows)",
             "shapes": NOT_YET + " (one model, its parameters all different in shape)",
             "groups": NOT_YET + " (the world's communicator only)",
             "orders": "allreduce_bucketed takes no order of actions",
             "accumulation": "the function averages what .grad holds; accumulating is the "
                             "caller's backward, before it"},
)

CHECKS = (
    Check(f"one Allreduce carries all {TOTAL} gradient numbers",
          lambda mc: at_sizes(mc, lambda p: _one_message(mc, p))),
    Check("every gradient equals the whole-batch gradient",
          lambda mc: at_sizes(mc, lambda p: _after(mc, p, 1))),
    Check("two SGD steps match the single process, gradients and weights",
          lambda mc: at_sizes(mc, lambda p: _after(mc, p, 2))),
    Check("parameters without a gradient (frozen, unused) are left out, the rest averaged",
          lambda mc: at_sizes(mc, lambda p: _skips_missing(mc, p))),
)
check = checker(CHECKS)
