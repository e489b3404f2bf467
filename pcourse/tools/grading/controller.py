"""The grader's ipcontroller: ipyparallel's own, with its engine sockets where engines look.

Over ``ipc://`` ipyparallel 9's controller names a socket ``PATH-PORT`` and its engines
connect to ``PATH:PORT``; this names them ``PATH:PORT`` as the engines do (and sockets
are created with umask 0, so that the jail's ``nobody`` may connect: the folder that
holds them is the grader's alone, see :func:`pcourse.tools.grading.sandbox.jail`).
"""

from __future__ import annotations

import os

from ipyparallel.controller import app


def _url(self: app.IPController, kind: str, channel: str, index: int | None = None) -> str:
    info = {"engine": self.engine_info, "client": self.client_info,
            "internal": self.internal_info}[kind]
    port = info[channel] if index is None else info[channel][index]
    return f"{info['interface']}:{port}"


if __name__ == "__main__":
    os.umask(0)
    app.IPController.construct_url = _url
    app.main()
