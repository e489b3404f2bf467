"""The grader's relay (pcourse.tools.grading.relay): the parts that need no job.

End to end, through jailed learner processes, it is tested by grading a class
(tests/test_grading.py): every solution passes through it, and the trusted wrong
answers of exercise 03 that rewrite their calls' record or forge the trial are
rejected there.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcourse.tools.grading import checks, relay, wire
from pcourse.tools.grading.wire import Call

RING = [Call("Sendrecv", 334, 1), Call("Sendrecv", 334, 1), Call("Sendrecv", 333, 1),
        Call("Sendrecv", 333, 1)]


def _outcome(value: object, made: list[Call]) -> dict:
    return {"rank": 0, "value": wire.dumps(value), "calls": made}


def test_a_trials_account_of_its_calls_is_taken_only_where_it_is_the_ranks_record():
    honest = {"got": np.ones(3), "calls": RING}
    assert checks._value(_outcome(honest, RING), 3, 0, True)["calls"] == RING
    allreduce = [*RING, Call("Allreduce", 1001, None)]
    per_step = {"grads": [], "calls": [RING[:2], RING[2:]]}  # steps: the record, split in order
    assert checks._value(_outcome(per_step, RING), 3, 0, True) == per_step
    for forged in ({"got": np.ones(3), "calls": RING},  # the Allreduce popped from the record
                   {"got": np.ones(3), "calls": allreduce[::-1]},  # reordered
                   {"got": np.ones(3), "calls": [*allreduce, RING[0]]},  # one made up
                   {"got": np.ones(3)}):  # none reported
        with pytest.raises(checks.ExerciseError, match="other than the 5 its rank made"):
            checks._value(_outcome(forged, allreduce), 3, 0, True)
    # a trial that reports no calls is not held to the record (its own messages are in it)
    assert checks._value(_outcome([1.0], allreduce), 3, 0, False) == [1.0]


def test_a_result_that_is_not_data_is_refused_not_rebuilt():
    with pytest.raises(checks.ExerciseError, match="not data"):
        checks._value({"rank": 1, "value": b"\x80\x04not a pickle", "calls": []}, 2, 1, False)


def test_the_rank_refuses_a_message_that_reaches_past_its_array():
    buf = np.zeros(4)
    for fine in (buf, [buf, 4], [buf, (1, 3)], [buf, (2, 2), (0, 2)], [buf, 1, 3]):
        relay._check_message(fine)
    for past in ([buf, 5], [buf, (3, 3)], [buf, (2, 2), (0, 3)], [buf, 2, 3], [buf, -1],
                 [buf, 1.5], [buf, 1, 1, 1]):
        with pytest.raises(ValueError, match="message"):
            relay._check_message(past)


def test_the_rank_passes_on_what_it_was_sent_and_nothing_it_holds_not():
    ln = relay.Link(None)  # type: ignore[arg-type]
    assert relay._decode(ln, wire.Obj({"port": 29500}), []) == {"port": 29500}
    buffers: list = []
    got = relay._decode(ln, ("x", [np.arange(3.0), 2]), buffers)
    assert got[0] == "x" and buffers[0] is got[1][0]  # an array is a buffer, handed back after
    for bad in (wire.Ref(7), wire.Mpi("NOT_A_CONSTANT"), object()):
        with pytest.raises((ValueError, TypeError)):
            relay._decode(ln, bad, [])
    for forged in (wire.Learner("f"), wire.Call("Send", 1, 0), wire.Made(0, 0, 1)):
        with pytest.raises(relay._Tamper):
            relay._decode(ln, forged, [])
