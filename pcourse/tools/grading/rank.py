"""One rank of a learner's grading job: an MPI process that runs only the course's code.

``mpiexec -n 4 python -m pcourse.tools.grading.rank SOCKET`` (started by
:class:`pcourse.tools.grading.job.Job`, in the jail where there is one). Each rank
connects to the grader at SOCKET and says which rank it is, then does what the grader
asks, answering each in turn:

- ``("open", path, codes, timeout)``: connect to the learner process listening at
  ``path`` (a fresh child of it for each exercise) and run the learner's ``codes`` there
  (the setup's imports, then their cells): ``("ok",)``, or the learner's error;
- ``("trial", ranks, spec, timeout)``: run a check's trial at ``ranks`` ranks in the
  learner process, making and recording its MPI calls (:func:`pcourse.tools.grading.relay.trial`);
- ``("end",)``: exit.

Every message is :mod:`~pcourse.tools.grading.wire` data both ways, and so is every object
the ranks send each other for the learner's pickle-based calls (``comm.bcast``...):
mpi4py's ``MPI.pickle`` is set to the wire format here, so no rank unpickles anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pcourse.tools.grading import relay, wire


def _open(path: str, codes: list[str], timeout: float) -> tuple:
    try:
        relay.open_link(Path(path))
    except RuntimeError:
        return ("died",)
    for code in codes:
        answer = relay.exchange(("define", code), timeout)
        if answer != ("ok",):
            return answer
    return ("ok",)


def main(where: str) -> None:
    from mpi4py import MPI

    relay.die_with_parent()  # its launcher's: a grader killed takes its job with it
    # objects between ranks: data only. Re-initialising MPI.pickle is mpi4py's documented way
    # to change its serializer, which mypy calls unsound on an instance (hence the ignore).
    MPI.pickle.__init__(wire.dumps, wire.loads)  # type: ignore[misc]
    sock = relay.connect(Path(where), timeout=60.0)
    relay.send(sock, ("hello", MPI.COMM_WORLD.rank))
    # torch now, while the learner processes warm up and before any trial: mpi4py's object
    # reductions add the learner's tensors here, and an import there, inside a collective's
    # deadline, made the other ranks time out on a loaded machine
    import torch  # noqa: F401
    while True:
        try:
            message = relay.receive(sock)
        except (EOFError, OSError):
            return
        answer: tuple | dict | None
        if message[0] == "open":
            answer = _open(*message[1:])
        elif message[0] == "trial":
            answer = relay.trial(*message[1:])
        else:
            return
        relay.send(sock, answer)


if __name__ == "__main__":
    main(sys.argv[1])
