"""Execute a lesson with some of its settings changed, and say which cells failed.

    python .ci/run_lesson.py notebooks/04_four_backends.ipynb out.ipynb --set N_ENGINES=1

For running a lesson where its defaults do not fit (one GPU: one engine), as
.ci/gpu-run does. Every cell runs even after one fails; the executed notebook is
written to the output path, and the text of every cell that mentions NCCL or fails
is printed. Exits 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import re
import sys

import nbformat
from nbclient import NotebookClient


def with_settings(nb: nbformat.NotebookNode, settings: dict[str, str]) -> None:
    """Replace each ``NAME = ...`` line of the first code cell that sets NAME."""
    for name, value in settings.items():
        line = re.compile(rf"^{re.escape(name)}\s*=.*$", re.M)
        cell = next((c for c in nb.cells if c.cell_type == "code" and line.search(c.source)),
                    None)
        if cell is None:
            sys.exit(f"no cell sets {name}")
        cell.source = line.sub(f"{name} = {value}", cell.source, count=1)


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"] + ("  [+image]" if "image/png" in out.data
                                                   else ""))
    return "\n".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebook")
    p.add_argument("out")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--cell-timeout", type=float, default=300)
    args = p.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    with_settings(nb, dict(s.split("=", 1) for s in args.set))
    client = NotebookClient(nb, timeout=args.cell_timeout, kernel_name="python3",
                            allow_errors=True, resources={"metadata": {"path": "notebooks"}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, args.out)
    failed = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error = any(o.output_type == "error" for o in cell.get("outputs", []))
        failed += error
        if error or "nccl" in cell.source.lower() or "nccl" in text_of(cell).lower():
            print(f"--- cell {i}{' FAILED' if error else ''}\n{text_of(cell)[-3000:]}")
    print(f"{failed} cell(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
