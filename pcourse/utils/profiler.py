"""The events of a torch.profiler run, read from the Chrome trace it exports.

torch.profiler's Python objects give operators and their times, but the memory events'
running totals (``Total Allocated``) and the exact start of each event on the trace's
clock are in the exported trace only; so the course reads that, through a temporary
file that is always removed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def chrome_events(prof: Any) -> list[dict]:
    """``prof``'s events (a finished ``torch.profiler.profile``), as its Chrome trace
    lists them (``traceEvents``)."""
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        return json.loads(Path(tmp).read_text())["traceEvents"]
    finally:
        os.unlink(tmp)
