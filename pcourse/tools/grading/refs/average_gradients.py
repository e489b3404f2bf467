"""Exercise 02, average the gradients: ``average_gradients_pickle`` and
``average_gradients_buffer``.

The reference is one process on the whole batch (:func:`~.common.single_process_sgd`): with
equal shards and a mean loss, the average of the ranks' gradients is that gradient. The
model is the general one (float64, a weight stored transposed, a frozen bias and an unused
layer where asked).
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
    uses,
)
from pcourse.tools.grading.refs.common import differ, gradient_trial, names, single_process_sgd

PICKLE, BUFFER = Learner("average_gradients_pickle"), Learner("average_gradients_buffer")


def _averages(mc: Any, fn: Learner, p: int, method: str, instead_of: str | None = None
              ) -> str | None:
    want = single_process_sgd()["grads"][0]  # one process, the whole batch
    got = run(mc, gradient_trial, fn, ranks=p)
    return per_rank(got, lambda r, o: uses(o["calls"][0], method, instead_of)
                    or differ(o["grads"][0], want, names()))


def _in_place(mc: Any, p: int) -> str | None:
    want = single_process_sgd()["grads"][0]
    got = run(mc, gradient_trial, BUFFER, ranks=p)
    return per_rank(got, lambda r, o: differ(o["grads"][0], want, names()) or (
        None if o["in_place"] else "a gradient was replaced by a new tensor; reduce and divide "
                                   "in place"))


def _skips_missing(mc: Any, p: int) -> str | None:
    # a frozen bias and an unused layer end backward with grad None: skip them, as torch does
    want = single_process_sgd(frozen=True)["grads"][0]
    for fn in (PICKLE, BUFFER):
        got = run(mc, gradient_trial, fn, frozen=True, ranks=p)
        problem = per_rank(got, lambda r, o: differ(o["grads"][0], want, names(frozen=True)))
        if problem:
            return f"{fn.name}, {problem}"
    return None


CONTRACT = Contract(
    dtypes=(torch.float64,),  # the general model (common.make_model(general=True))
    layouts=("a weight stored transposed (its gradient not contiguous)",),
    aliasing=("the gradients: averaged in place, the same tensors after the call",),
    why_not={"dtypes": NOT_YET + " (float64 is where a float32 round trip shows)",
             "shapes": NOT_YET + " (one model whose parameters all differ in shape)",
             "groups": NOT_YET + " (the world's communicator only)",
             "orders": "the functions take no order of actions",
             "accumulation": "the functions average what .grad holds; accumulating is the "
                             "caller's backward, before them"},
)

CHECKS = (
    Check("pickle-based average equals the whole-batch gradient",
          lambda mc: at_sizes(mc, lambda p: _averages(mc, PICKLE, p, "allreduce"))),
    Check("buffer-based average equals the whole-batch gradient",
          lambda mc: at_sizes(mc, lambda p: _averages(mc, BUFFER, p, "Allreduce", "allreduce"))),
    Check("buffer-based average works in place",
          lambda mc: at_sizes(mc, lambda p: _in_place(mc, p))),
    Check("parameters without a gradient (frozen, unused) are left alone",
          lambda mc: at_sizes(mc, lambda p: _skips_missing(mc, p))),
)
check = checker(CHECKS)
