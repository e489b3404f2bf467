"""The notebook's view of the engines: blocking calls that an interrupt stops, engines too.

ipyparallel's own blocking calls swallow KeyboardInterrupt and leave the engines
running; the cell then returns an AsyncResult and the next cell queues behind the old
work. :class:`InterruptibleView`, the view ``start_cluster`` gives the notebook
(``mc.view``), sends the engines SIGINT too (as ``%%px`` does), gives them time to stop
(:data:`~pcourse.tools.cluster.interrupts.INTERRUPT_GRACE`: the engines' watcher ends a
rank that cannot) and raises the interrupt in the notebook; while it waits it shows what
rank 0 publishes (``train``'s epochs) as a progress bar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipyparallel as ipp

from pcourse.runtime import private
from pcourse.tools.cluster.failures import ClusterError
from pcourse.tools.cluster.interrupts import INTERRUPT_GRACE
from pcourse.utils.progress import Bar, latest


class InterruptibleView(ipp.DirectView):
    """A DirectView whose blocking calls pass an interrupt on to the engines.

    A cluster that has died says so, in one line (``problem``, set by ``start_cluster``),
    instead of ipyparallel's errors about missing engines.
    """

    problem: Callable[[], str] = staticmethod(lambda: "")  # MPICluster.problem, once it exists

    # ipyparallel's private entry of every apply (pcourse.runtime.private.VIEW_APPLY)
    def _really_apply(self, f: Any, args: Any = None, kwargs: Any = None,  # type: ignore[override]
                      targets: Any = None, block: bool | None = None, **options: Any) -> Any:
        self._refuse_if_dead()
        block = self.block if block is None else block
        ar = super()._really_apply(f, args, kwargs, targets=targets, block=False, **options)
        return _finish(ar, self.client) if block else ar

    def execute(self, code: str, silent: bool = True, targets: Any = None,  # type: ignore[override]
                block: bool | None = None, label: str | None = None) -> Any:
        self._refuse_if_dead()
        block = self.block if block is None else block
        ar = super().execute(code, silent=silent, targets=targets, block=False, label=label)
        if block:
            _finish(ar, self.client)
            ar.wait_for_output()
        return ar

    def _refuse_if_dead(self) -> None:
        problem = self.problem()
        if problem:
            raise ClusterError(problem)


def _finish(ar: Any, client: ipp.Client) -> Any:
    try:
        _show_progress(ar)
        return ar.get()
    except KeyboardInterrupt:
        try:
            client.send_signal("SIGINT", targets=private.targets_of(ar), block=False)
            ar.wait(INTERRUPT_GRACE + 2)  # they stop, or the rank that cannot ends the job
        except Exception:  # noqa: BLE001 - the interrupt is what the user must see
            pass
        raise


def _show_progress(ar: Any) -> None:
    """Wait for ``ar``, showing what rank 0 publishes (``train``'s epochs) as a bar."""
    bar = None
    try:
        while not ar.wait(0.2):
            state = latest(ar.data)
            if state is not None:
                bar = bar or Bar(state[1], desc="rank 0", unit="step")
                bar.update(state[0], state[1], state[2])
    finally:
        if bar is not None:
            bar.close()
