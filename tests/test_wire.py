"""Nothing learner code sends back can run: the wire format (pcourse.tools.grading.wire) and
every reader of it on the grading path, attacked as a hostile learner would.

Every attack is fed to the readers that meet learner bytes: :func:`wire.loads` (the rank
reading its learner process, the grader reading a rank, mpi4py's object messages between
ranks), and :func:`checks.run` (a trial's result becoming a row). Each is refused with a
reason, and nothing of it runs: a canary that every payload would flip stays as it was.
"""

from __future__ import annotations

import builtins
import copyreg
import io
import pickle
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pcourse.tools.grading import checks, wire
from pcourse.tools.grading.job import Job

REPO = Path(__file__).resolve().parents[1]
RAN: list[str] = builtins.__dict__.setdefault("pcourse_wire_ran", [])  # a payload that runs
#                                                                        appends here


def _text(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


CANARY = "__import__('builtins').pcourse_wire_ran.append('ran')"
# The payload: protocol 4 walks the dotted name numpy.dtypes.__builtins__.get to exec
DOTTED = (b"\x80\x04" + _text("numpy.dtypes") + _text("__builtins__.get") + b"\x93"
          + _text("exec") + b"\x85R" + _text(CANARY) + b"\x85R.")
GLOBAL = b"cbuiltins\nexec\n(V" + CANARY.encode() + b"\ntR."  # protocol 0, by name


class Gadget:
    def __reduce__(self) -> tuple:
        return (exec, (CANARY,))


def _reconstructed() -> bytes:
    """A pickle that rebuilds through copyreg's reconstructor (protocol 0/1 objects)."""
    return pickle.dumps(copyreg._reconstructor, protocol=0) + pickle.dumps(Gadget(), protocol=1)


def _torch_save() -> bytes:
    buf = io.BytesIO()
    torch.save({"x": torch.ones(2), "gadget": Gadget()}, buf)
    return buf.getvalue()


ATTACKS = {
    "the issue's payload (numpy.dtypes.__builtins__.get)": DOTTED,
    "exec named by GLOBAL": GLOBAL,
    "a __reduce__ gadget": pickle.dumps(Gadget()),
    "copyreg's reconstructor": _reconstructed(),
    "numpy's object array, np.save(allow_pickle=True)":
        (lambda b: (np.save(b, np.array([Gadget()], dtype=object), allow_pickle=True),
                    b.getvalue())[1])(io.BytesIO()),
    "torch.save with a gadget": _torch_save(),
    "a wire header, then a pickle": wire.MAGIC + pickle.dumps(Gadget()),
}


@pytest.fixture(autouse=True)
def _nothing_ran():
    RAN.clear()
    yield
    assert RAN == [], "a payload ran"


def test_the_canary_works():
    """The payloads are live: pickle runs each one (so refusing them below means something)."""
    for name in ("the issue's payload (numpy.dtypes.__builtins__.get)", "exec named by GLOBAL",
                 "a __reduce__ gadget"):
        pickle.loads(ATTACKS[name])
        assert RAN == ["ran"], name
        RAN.clear()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_every_attack_is_refused_by_the_reader_and_runs_nothing(name):
    with pytest.raises(wire.WireError) as info:
        wire.loads(ATTACKS[name])
    assert str(info.value)  # a reason, for the row


class FakeJob(Job):
    """A grading job whose ranks answer a trial with the given bytes (no processes)."""

    def __init__(self, values: list) -> None:
        self.n, self.broken, self.opened, self.jailed = len(values), "", 1, True
        self.values = values

    def trial(self, spec: tuple, ranks: int, timeout: float) -> tuple[list, bool]:
        return [None] * (self.n - ranks) + [
            {"rank": r, "value": self.values[self.n - 1 - r], "calls": []}
            for r in reversed(range(ranks))], True

    def close(self) -> None:
        pass


def _trial() -> None:
    """Stands for a trial: checks.run names it and never runs it here."""


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_result_that_is_an_attack_is_a_row_with_its_reason(name):
    job = FakeJob([wire.dumps({"fine": 1}), ATTACKS[name], wire.dumps(2)])
    check = checks.Check("anything", lambda mc: checks.at_sizes(
        mc, lambda p: None if checks.run(mc, _trial, ranks=p) else "?"))
    problem = checks.outcome(check, job)
    assert problem is not None and "at 2 ranks, rank 1 sent back a result that is not data" \
        in problem, problem


def test_what_cannot_be_data_is_refused_when_written():
    storage = torch.ones(2).untyped_storage()
    for value in (Gadget(), np.array([object()]), storage, torch.ones(2).to_sparse(), {1, 2},
                  print, type, [Gadget()], {"k": Gadget()}, 1 << 600):
        with pytest.raises(TypeError, match="not|bits"):
            wire.dumps(value)


def test_plain_data_goes_and_comes_back_as_it_was():
    t = torch.randn(3, 4, dtype=torch.float64).t()  # not contiguous
    value = {"a": [1, -2.5, None, True, (3, "é\ud800"), b"\x00"], 7: np.arange(6).reshape(2, 3),
             (1, "k"): t, "bf16": torch.ones(2, dtype=torch.bfloat16) / 3,
             "int16": torch.arange(5, dtype=torch.int16), "empty": np.empty((0, 3)),
             "calls": [wire.Call("Send", 3, 1), wire.Call("Barrier", 1, None)],
             "big": -(1 << 200), "c": 1 - 2j, "obj": wire.Obj([wire.Learner("f")])}
    back = wire.loads(wire.dumps(value))
    assert back.keys() == value.keys()
    assert back["a"] == value["a"] and back["big"] == value["big"] and back["c"] == value["c"]
    assert np.array_equal(back[7], value[7]) and back[7].dtype == value[7].dtype
    for key in ((1, "k"), "bf16", "int16"):
        assert torch.equal(back[key], value[key]) and back[key].dtype == value[key].dtype
    assert back["calls"] == value["calls"] and type(back["calls"][0]) is wire.Call
    assert back["obj"] == value["obj"] and back["empty"].shape == (0, 3)
    back[7][0, 0] = 99  # an array of its own, writable (a Recv writes into it)


def test_nesting_and_sizes_are_bounded_before_anything_is_built():
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(TypeError, match="nested"):
        wire.dumps(deep)
    nested = wire.MAGIC + (b"l" + struct.pack("<Q", 1)) * (wire.MAX_DEPTH + 5) + b"N"
    forged = {
        "nested past the limit": nested,
        "a list of 2**60 items in a few bytes": wire.MAGIC + b"l" + struct.pack("<Q", 1 << 60),
        "a string longer than the data": wire.MAGIC + b"s" + struct.pack("<Q", 1 << 40) + b"x",
        "an array of 2**62 elements": wire.MAGIC + b"a" + bytes([12, 2])
        + struct.pack("<QQQ", 1 << 31, 1 << 31, 8),
        "a shape whose product overflows": wire.MAGIC + b"a" + bytes([12, 3])
        + struct.pack("<QQQQ", 1 << 63, 1 << 63, 4, 0),
        "an unknown dtype": wire.MAGIC + b"a" + bytes([200, 0]) + struct.pack("<Q", 0),
        "an unknown record": wire.MAGIC + b"r" + bytes([250, 0]),
        "a record of the wrong arity": wire.MAGIC + b"r" + bytes([0, 1]) + b"N",
        "an unhashable key": wire.MAGIC + b"d" + struct.pack("<Q", 1)
        + b"l" + struct.pack("<Q", 0) + b"N",
        "bytes left over": wire.dumps(1) + b"N",
        "not UTF-8": wire.MAGIC + b"s" + struct.pack("<Q", 2) + b"\xff\xfe",
        "an unknown tag": wire.MAGIC + b"?",
        "nothing": b"",
        "not bytes": 42,
        "a count cut short": wire.MAGIC + b"l\x01",
    }
    for name, data in forged.items():
        with pytest.raises(wire.WireError):
            wire.loads(data)
            pytest.fail(name)


def test_random_bytes_are_refused_or_read_never_anything_else():
    """Seeded: thousands of random inputs and mutations of real messages, each either a
    value or a WireError (never another exception, never code run)."""
    rng = random.Random(54)
    seeds = [wire.dumps(v) for v in (
        {"got": np.arange(10.0), "calls": [wire.Call("Sendrecv", 4, 1)] * 3},
        ("call", 0, "Sendrecv", (np.zeros(3), 1), {"source": 2}),
        [torch.ones(2, 3), wire.Obj({"port": 29500}), wire.Made(3, 0, 2)])]
    refused = read = 0
    for k in range(6000):
        if k % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            data = (wire.MAGIC if k % 2 else b"") + data
        else:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            if k % 5 == 0:
                data = data[:rng.randrange(len(data))]
        try:
            wire.loads(bytes(data))
            read += 1
        except wire.WireError:
            refused += 1
    assert refused > 4000 and read > 0, (refused, read)


def test_no_unpickling_anywhere_on_the_grading_path():
    """The grading package holds no call that turns bytes into code: no unpickling, no
    torch.load, no eval, no numpy object arrays (the learner process's exec of the
    learner's own cells is the one exec, in the process that runs learner code anyway)."""
    found = []
    pattern = re.compile(r"pickle\.loads?\(|Unpickler|cloudpickle|torch\.load\(|"
                         r"(?<![.\w])eval\(|allow_pickle\s*=\s*True|marshal\.loads?\(|"
                         r"shelve|jsonpickle|dill\.")
    for path in sorted((REPO / "pcourse" / "tools" / "grading").rglob("*.py")):
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(text.split("#")[0]):
                found.append(f"{path.relative_to(REPO)}:{n}: {text.strip()}")
    assert found == [], "\n".join(found)
    execs = [p.name for p in (REPO / "pcourse" / "tools" / "grading").rglob("*.py")
             if re.search(r"(?<![.\w])exec\(", p.read_text())]
    assert execs == ["learner.py"], execs


def test_the_ranks_read_each_others_objects_as_wire_data_only(mpi_run):
    """A learner's rank can Send raw bytes that another's pickle-based recv reads: on the
    grader's ranks mpi4py's pickle is the wire format, so a pickle sent so runs nothing."""
    out = mpi_run(2, "check_wire_between_ranks.py", timeout=120)
    assert "wire between ranks OK" in out, out
