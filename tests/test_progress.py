"""Progress of long cells: seen while they run, nothing left in the saved notebook."""

from __future__ import annotations

import io
import sys

import pytest

from pcourse.utils import progress


def _run(bar: progress.Bar, total: int) -> None:
    for done in range(total + 1):
        bar.update(done, postfix=f"step {done}")
    bar.close()


@pytest.fixture
def shown(monkeypatch) -> list[dict]:
    """What a notebook would display, version by version (the first, then each update)."""
    bundles: list[dict] = []

    class Handle:
        def update(self, bundle, raw):
            bundles.append(bundle)

    def display(bundle, raw, display_id):
        bundles.append(bundle)
        return Handle()

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", display)
    return bundles


def test_a_notebook_cell_keeps_nothing(shown):
    """Learners see the bar; the saved cell, which nbval compares, keeps nothing."""
    _run(progress.Bar(2, "engines", "engine"), 2)
    # nbval keeps the first version (it ignores updates), nbclient the last: both empty,
    # so neither the saved cell nor nbval's comparison holds an output field.
    assert shown[0] == {} and shown[-1] == {}
    assert [b["text/plain"].split("|")[-1].split()[0] for b in shown[1:-1]] == \
        ["0/2", "1/2", "2/2"]
    assert "step 2" in shown[-2]["text/plain"]


def test_a_terminal_bar_clears_itself(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    _run(progress.Bar(2, "engines", "engine"), 2)
    line = ""
    for part in err.getvalue().split("\r"):  # what the terminal shows: \r overwrites
        line = part + line[len(part):]
    assert "2/2" in err.getvalue() and line.strip() == ""


def test_an_engine_publishes_and_the_kernel_reads_the_last_state(monkeypatch):
    published = []
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    monkeypatch.setattr(progress, "on_engine", lambda: True)
    monkeypatch.setattr("ipyparallel.datapub.publish_data", published.append)
    _run(progress.Bar(3, "franke ×2"), 3)
    assert [p[progress.KEY][:2] for p in published] == [(d, 3) for d in range(4)]
    # an AsyncResult's data: one dict per engine, rank 0's holds the last state
    state = progress.latest([published[-1], {}])
    assert state[:3] == (3, 3, "franke ×2: step 3")
    assert progress.latest([{}, {}]) is None


def test_nowhere_to_show_it_shows_nothing(monkeypatch, capsys):
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    _run(progress.Bar(2, "quiet"), 2)  # pytest's captured stderr is not a terminal
    assert capsys.readouterr() == ("", "")


@pytest.mark.mpi
def test_training_on_the_engines_shows_rank_0s_epochs_in_the_notebook(shown):
    """train() on the engines publishes; the blocking apply shows it, then empties it."""
    from pcourse.tools.cluster import start_cluster, stop_cluster

    def _train_on_engine(epochs):  # local, so cloudpickle sends it by value
        from pcourse.backends import make_backend
        from pcourse.loop import train
        from pcourse.workloads.config import FrankeConfig

        with make_backend("mpi") as backend:
            return train("franke", backend, FrankeConfig.quick(epochs=epochs)).final_loss

    mc = start_cluster(2)
    try:
        shown.clear()  # the start's own bar
        losses = mc.view.apply_sync(_train_on_engine, 150)  # long enough to be seen
    finally:
        stop_cluster(mc)
    assert losses[0] == losses[1]
    assert shown and shown[0] == {} and shown[-1] == {}, shown
    assert any("franke ×2" in b.get("text/plain", "") for b in shown[1:-1]), shown
