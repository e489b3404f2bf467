"""The grader's relay (pcourse.tools.grading.relay): the parts that need no cluster.

End to end, through jailed learner processes, it is tested by grading a class
(tests/test_grading.py): every solution passes through it, and the trusted wrong
answers of exercise 03 that rewrite their calls' record or forge the trial are
rejected there.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pcourse.tools.grading import harness, relay
from pcourse.tools.grading.trials import Call

RING = [Call("Sendrecv", 334, 1), Call("Sendrecv", 334, 1), Call("Sendrecv", 333, 1),
        Call("Sendrecv", 333, 1)]


def _outcome(value: object, made: list[Call]) -> dict:
    return {"rank": 0, "value": pickle.dumps(value, protocol=relay.PROTOCOL), "calls": made}


def test_a_trials_account_of_its_calls_is_taken_only_where_it_is_the_engines_record():
    honest = {"got": np.ones(3), "calls": RING}
    assert harness._relayed_value(_outcome(honest, RING), 3, True)["calls"] == RING
    allreduce = [*RING, Call("Allreduce", 1001, None)]
    per_step = {"grads": [], "calls": [RING[:2], RING[2:]]}  # steps: the record, split in order
    assert harness._relayed_value(_outcome(per_step, RING), 3, True) == per_step
    for forged in ({"got": np.ones(3), "calls": RING},  # the Allreduce popped from the record
                   {"got": np.ones(3), "calls": allreduce[::-1]},  # reordered
                   {"got": np.ones(3), "calls": [*allreduce, RING[0]]},  # one made up
                   {"got": np.ones(3)}):  # none reported
        with pytest.raises(harness.ExerciseError, match="other than the 5 its engine made"):
            harness._relayed_value(_outcome(forged, allreduce), 3, True)
    # a trial that reports no calls is not held to the record (its own messages are in it)
    assert harness._relayed_value(_outcome([1.0], allreduce), 3, False) == [1.0]


class Smuggled:
    def __reduce__(self) -> tuple:
        return (print, ("ran in the kernel",))


def test_a_result_that_is_not_data_is_refused_not_rebuilt():
    value = harness._relayed_value(_outcome({"got": Smuggled()}, []), 2, False)
    assert harness._refusals(value) == "builtins.print"
    with pytest.raises(harness.ExerciseError, match="does not open"):
        harness._relayed_value({"rank": 1, "value": b"\x80\x04not a pickle", "calls": []}, 2,
                               False)


def test_the_engine_refuses_a_message_that_reaches_past_its_array():
    buf = np.zeros(4)
    for fine in (buf, [buf, 4], [buf, (1, 3)], [buf, (2, 2), (0, 2)], [buf, 1, 3]):
        relay._check_message(fine)
    for past in ([buf, 5], [buf, (3, 3)], [buf, (2, 2), (0, 3)], [buf, 2, 3], [buf, -1],
                 [buf, 1.5], [buf, 1, 1, 1]):
        with pytest.raises(ValueError, match="message"):
            relay._check_message(past)


def test_the_engine_passes_on_plain_data_only():
    ln = relay.Link(None)  # type: ignore[arg-type]
    assert relay._decode(ln, relay.Obj(pickle.dumps({"port": 29500})), []) == {"port": 29500}
    with pytest.raises(TypeError, match="plain data only"):
        relay._decode(ln, relay.Obj(pickle.dumps(relay.Link)), [])  # code, not data
    buffers: list = []
    got = relay._decode(ln, ("x", [np.arange(3.0), 2]), buffers)
    assert got[0] == "x" and buffers[0] is got[1][0]  # an array is a buffer, handed back after
    for bad in (relay.Ref(7), relay.Mpi("NOT_A_CONSTANT"), object(), np.array([object()])):
        with pytest.raises((ValueError, TypeError)):
            relay._decode(ln, bad, [])
