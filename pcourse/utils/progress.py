"""Progress of a long cell, shown while it runs and gone once it is over.

A learner expects a bar while engines start, a benchmark sweeps or a model trains;
the course's notebooks are also tested by executing them with nbval, which compares
every saved output. :class:`Bar` serves both, wherever the code runs:

- **in a notebook's kernel**: a display that starts empty, is updated in place, and
  is emptied at the end. nbval records only the first, empty, version (it ignores
  updates), so its comparison sees nothing. nbclient stores the last version: an
  empty display, which a kernel cannot take back (only clear the whole cell), so the
  tool that stores a lesson's outputs removes it
  (:func:`pcourse.tools.workshop.outputs.strip`, ``make lessons``);
- **on an ipyparallel engine** (rank 0 of a training run): the state is published
  with ipyparallel's ``publish_data``; the notebook's blocking ``apply`` shows it in
  such a display (:mod:`pcourse.tools.cluster.view` watches :func:`latest`);
- **in a terminal**: a tqdm bar on stderr that clears itself. Elsewhere (pipes,
  logs, tests): nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any

KEY = "progress"  # the published data's key: (done, total, line, extra)


class Bar:
    """``done`` of ``total`` steps of ``desc``, with a short ``postfix`` line."""

    def __init__(self, total: int, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.start = time.monotonic()
        self.shown: tuple[int, int, str] | None = None
        self.handle: Any = None
        self.bar: Any = None
        self.publish: Any = None
        if in_notebook():
            from IPython.display import display

            self.handle = display({}, raw=True, display_id=True)
        elif on_engine():
            from ipyparallel.datapub import publish_data

            self.publish = publish_data
        elif sys.stderr is not None and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False)

    def update(self, done: int, total: int | None = None, postfix: str = "") -> None:
        self.total = self.total if total is None else total
        if (done, self.total, postfix) == self.shown:
            return
        self.shown = (done, self.total, postfix)
        if self.bar is not None:
            self.bar.total, self.bar.n = self.total, done
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()  # steps may be seconds apart: draw each one
        elif self.handle is not None:
            self.handle.update({"text/plain": self.meter(done, postfix)}, raw=True)
        elif self.publish is not None:
            self.publish({KEY: (done, self.total, f"{self.desc}: {postfix}", None)})

    def meter(self, done: int, postfix: str = "") -> str:
        from tqdm import tqdm

        return tqdm.format_meter(done, self.total or None, time.monotonic() - self.start,
                                 prefix=self.desc, unit=self.unit, postfix=postfix or None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.handle is not None:
            self.handle.update({}, raw=True)  # an empty bundle: nothing shown, nothing compared
        self.bar = self.handle = self.publish = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def latest(data: Any) -> tuple | None:
    """The last published (done, total, line, extra), from an AsyncResult's ``data``."""
    for entry in data if isinstance(data, list) else [data]:
        if entry and KEY in entry:
            return entry[KEY]
    return None


def in_notebook() -> bool:
    """In a Jupyter kernel that a notebook (or nbclient) drives, not on an engine."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None and not on_engine()


def on_engine() -> bool:
    """In an ipyparallel engine, where ``publish_data`` reaches the notebook."""
    kernel_module = sys.modules.get("ipyparallel.engine.kernel")
    ipython = sys.modules.get("IPython")
    if kernel_module is None or ipython is None:
        return False
    shell = ipython.get_ipython()
    return isinstance(getattr(shell, "kernel", None), kernel_module.IPythonParallelKernel)
