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
