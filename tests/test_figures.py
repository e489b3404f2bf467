"""The timelines the lessons draw: every bar stays in sight, the legend beside it."""

from __future__ import annotations

import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from pcourse.tools.bench import overlap, pp, trace
from pcourse.utils.show import legend_beside, new_figure


def _x(name: str, cat: str, ts: float, dur: float, pid: int = 0) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid}


def _phases(cat: str) -> list[dict]:  # a step whose last phase runs to the right edge
    return [_x(n, cat, 1000.0 * k, 1000.0) for k, n in enumerate(trace.PHASES)]


TIMELINES = {
    "lesson 07's buckets": lambda ax: trace.plot({"traceEvents": _phases("phase") + [
        _x("bucket 0", "in flight", 500, 3000), _x("launch bucket 0", "call", 500, 50)]}, ax),
    "lesson 10's collectives": lambda ax: overlap.plot({"traceEvents": _phases("phase") + [
        _x("reduce_scatter 0", "in flight", 500, 3000), _x("wait", "wait", 3000, 500),
        _x("all_gather 1", "in flight", 3500, 500)]}, ax),
    "lesson 12's stages": lambda ax: pp.plot_timeline({"traceEvents": [
        _x("F 0", "", 0, 1000), _x("wait", "", 0, 1000, pid=1), _x("F 0", "", 1000, 1000, 1),
        _x("B 0", "", 2000, 1000, 1), _x("B 0", "", 3000, 1000)]}, ax),
}


def _legend_right_of_axes(ax) -> bool:
    canvas = FigureCanvasAgg(ax.figure)  # a closed pyplot figure keeps no canvas to draw on
    canvas.draw()
    renderer = canvas.get_renderer()
    box = ax.get_legend().get_window_extent(renderer)
    return box.x0 >= ax.get_window_extent(renderer).x1


@pytest.mark.parametrize("draw", TIMELINES.values(), ids=TIMELINES.keys())
def test_a_timelines_legend_is_beside_its_bars_with_each_label_once(draw):
    fig = new_figure(figsize=(6, 2), layout="constrained")
    ax = fig.add_subplot()
    draw(ax)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels and len(labels) == len(set(labels))
    assert _legend_right_of_axes(ax)


def test_a_legend_left_where_matplotlib_puts_it_covers_the_bars():
    # the check above can fail: matplotlib's own placement is inside the axes
    fig = new_figure(figsize=(6, 2))
    ax = fig.add_subplot()
    ax.barh(0, 10, label="a")
    ax.legend(loc="upper right")
    assert not _legend_right_of_axes(ax)
    legend_beside(ax)
    assert _legend_right_of_axes(ax)


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2), (3, 2, 4)])
def test_a_mesh_is_drawn_from_its_coordinates_every_rank_once(shape):
    from pcourse.tools.bench.tp import draw_mesh

    names = ["dp", "pp", "tp"][-len(shape):] if len(shape) == 3 else ["dp", "tp"]
    coords = []
    for r in range(math.prod(shape)):
        rest, c = r, {}
        for name, n in reversed(list(zip(names, shape, strict=True))):
            rest, c[name] = divmod(rest, n)
        coords.append({k: c[k] for k in names})
    fig = new_figure(figsize=(6, 3))
    ax = fig.add_subplot()
    draw_mesh(ax, coords)
    ranks = [t.get_text() for t in ax.texts if t.get_text().startswith("rank ")]
    assert ranks == [f"rank {r}" for r in range(len(coords))]
    assert names[-1] in ax.get_title() and names[0] in ax.get_title()
