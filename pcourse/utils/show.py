"""Show the package's own source in a notebook, so lessons never copy code.

A lesson that teaches ``ring_allreduce`` displays the function the package runs,
highlighted, instead of a pasted copy that drifts out of date.
"""

from __future__ import annotations

import inspect
from typing import Any


def show_source(*objects: Any) -> Any:
    """Display the source of functions, classes or modules, syntax-highlighted."""
    from IPython.display import Code

    source = "\n\n".join(inspect.getsource(obj) for obj in objects)
    return Code(source, language="python")
