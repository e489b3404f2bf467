"""Show things in a notebook: the package's own source, and figures that do show.

A lesson that teaches ``ring_allreduce`` displays the function the package runs,
highlighted, instead of a pasted copy that drifts out of date (:func:`show_source`).
The package's plotting helpers make their figures with :func:`new_figure`, so a
figure a lesson displays is stored as a picture, not as its text.
"""

from __future__ import annotations

import inspect
from typing import Any


def show_source(*objects: Any) -> Any:
    """Display the source of functions, classes or modules, syntax-highlighted."""
    from IPython.display import Code

    source = "\n\n".join(inspect.getsource(obj) for obj in objects)
    return Code(source, language="python")


def new_figure(**kwargs: Any) -> Any:
    """A matplotlib Figure (``kwargs`` as for ``plt.figure``) that a notebook shows once.

    A bare ``matplotlib.figure.Figure`` displayed before anything in the kernel used
    pyplot shows only its text, ``<Figure size ... with 1 Axes>``: it is pyplot that
    sets up a notebook's inline display of figures. So pyplot makes this one, and
    lets go of it at once: the caller shows it (``display(fig)``, or as a cell's
    value) or saves it, ``plt.show()`` does not draw it a second time, and a script
    that makes many keeps none open.
    """
    import matplotlib.pyplot as plt

    fig = plt.figure(**kwargs)
    plt.close(fig)
    return fig


def legend_beside(ax: Any) -> None:
    """A timeline's legend, each label once, to the right of its axes: inside, it would
    cover the bars of a step that runs to the right edge."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def draw_mesh(ax: Any, coords: list[dict[str, int]], title: str = "") -> None:
    """The ranks of a mesh (``coords[r]``: rank r's coordinate on each named dimension,
    outermost first, as :class:`pcourse.mesh.Mesh` gives them), one box each: the
    outermost dimension side by side, the next down the page (if there are three), the
    innermost across; a shaded band joins each innermost group, lines the groups of the
    other dimensions (solid: the middle one, dashed: the outermost)."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    dims = list(coords[0])
    if not 2 <= len(dims) <= 3:
        raise ValueError(f"a mesh of 2 or 3 dimensions is drawn, got {dims}")
    outer, inner = dims[0], dims[-1]
    middle = dims[1] if len(dims) == 3 else None
    n_inner = 1 + max(c[inner] for c in coords)
    where = {}
    for r, c in enumerate(coords):
        x = c[outer] * (n_inner + 0.8) + c[inner]
        y = -c[middle] * 1.4 if middle else 0.0
        where[r] = (x, y)
        ax.add_patch(FancyBboxPatch((x - 0.38, y - 0.3), 0.76, 0.6, boxstyle="round,pad=0.02",
                                    fc=f"C{c[middle] if middle else 0}", alpha=0.35, ec="k"))
        ax.text(x, y + 0.08, f"rank {r}", ha="center", va="center", fontsize=8)
        ax.text(x, y - 0.13, " ".join(f"{d}{c[d]}" for d in dims), ha="center", va="center",
                fontsize=6)
    for a in where:
        for b in where:
            if a >= b:
                continue
            differ = [d for d in dims if coords[a][d] != coords[b][d]]
            if len(differ) != 1:
                continue
            (xa, ya), (xb, yb) = where[a], where[b]
            if differ[0] == inner:  # the innermost group: a band under its boxes
                ax.add_patch(FancyBboxPatch((min(xa, xb) - 0.45, ya - 0.37), abs(xb - xa) + 0.9,
                                            0.74, boxstyle="round,pad=0.02", fc="0.85",
                                            ec="none", zorder=0))
            elif differ[0] == middle:  # straight down, box edge to box edge
                top, low = sorted([(ya, xa), (yb, xb)], reverse=True)
                ax.plot([top[1], low[1]], [top[0] - 0.3, low[0] + 0.3], "-", color="0.3", lw=0.8)
            else:  # the outermost: an arc over the boxes between
                ax.add_patch(FancyArrowPatch((xa, ya + 0.3), (xb, yb + 0.3), arrowstyle="-",
                                             connectionstyle="arc3,rad=-0.3", ls="--",
                                             color="0.3", lw=0.8))
    xs, ys = zip(*where.values(), strict=True)
    ax.set(xlim=(min(xs) - 0.7, max(xs) + 0.7), ylim=(min(ys) - 0.6, max(ys) + 1.3),
           aspect="equal")
    ax.axis("off")
    key = f"grey band: a {inner} group"
    if middle:
        key += f"; solid: a {middle} group"
    ax.set_title((title + "\n" if title else "") + key + f"; dashed: a {outer} group", fontsize=8)
