"""A rank that fails says so before it leaves, so the others can name it (lesson 14).

A collective cannot know *which* rank is missing: it only sees that it did not
complete by its deadline (lesson 04). The rank that failed knows, as long as it lives
long enough to raise. So each rank opens a side channel before it trains (a duplicate of
its backend's communicator: its messages never meet the training's), and a rank whose
loop raises first sends every other rank one short message, why, without waiting for
anyone to take it. A rank whose collective then times out looks for such messages, and
its error names the rank that failed and says why, or says that no rank said so (a
rank killed outright says nothing: there, what the launcher saw names it).

Only what the failing rank said is reported, never a guess: a rank that hears nothing
raises the timeout as it was. The channel needs an MPI communicator (the MPI backends;
elsewhere :class:`Notices` hears nothing and tells no one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pcourse.backends.base import Backend
from pcourse.runtime.waits import CollectiveTimeout

__all__ = ["Notices", "RankFailed", "failing_loudly"]

_LONGEST = 1024  # bytes of a notice: the error's type and first line
_TAG = 14  # the only tag on the side channel
_sent: list[Any] = []  # requests never waited for: their buffers must outlive this rank's loop


class RankFailed(RuntimeError):
    """Another rank failed, and said so: its rank and its error are in the message."""


class Notices:
    """The side channel. Collective to open (every rank of ``backend`` at once)."""

    def __init__(self, backend: Backend) -> None:
        comm = getattr(backend, "comm", None)
        self.comm = comm.Dup() if comm is not None and hasattr(comm, "Iprobe") else None
        self.rank, self.size = backend.rank, backend.size

    def tell(self, error: BaseException) -> None:
        """Send every other rank why this one fails (eagerly, waiting for no one)."""
        if self.comm is None:
            return
        first = (str(error).splitlines() or [""])[0]
        text = bytearray(f"{type(error).__name__}: {first}".encode()[:_LONGEST])
        for peer in range(self.size):
            if peer != self.rank:
                _sent.append((text, self.comm.Isend(text, dest=peer, tag=_TAG)))

    def heard(self) -> list[tuple[int, str]]:
        """The notices that have arrived, as (rank, why), in rank order."""
        if self.comm is None:
            return []
        from mpi4py import MPI

        got, status = [], MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            buffer = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv(buffer, source=status.Get_source(), tag=_TAG)
            got.append((status.Get_source(), buffer.decode(errors="replace")))
        return sorted(got)

    def close(self) -> None:
        """Free the channel: only where every rank got through (freeing is collective)."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


@contextmanager
def failing_loudly(backend: Backend) -> Iterator[Notices]:
    """Run a rank's loop inside: if it raises, the other ranks are told why; if one of
    its collectives times out, the error names the ranks that said they failed
    (:class:`RankFailed`, from the timeout), or is the timeout as it was."""
    notices = Notices(backend)
    try:
        yield notices
    except CollectiveTimeout as exc:
        heard = notices.heard()
        if heard:
            said = "; ".join(f"rank {r} failed ({why})" for r, why in heard)
            raise RankFailed(f"{said}, and said so before it left; here, {exc}") from exc
        raise
    except BaseException as exc:
        notices.tell(exc)
        raise
    notices.close()
