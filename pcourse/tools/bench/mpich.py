"""Which allreduce MPICH runs, and why a Python ring can beat it on one machine.

``python -m pcourse.tools.bench mpich-allreduce --ranks 2`` runs ``pcourse.tools.bench comm``
once per MPICH allreduce algorithm, forcing each with MPICH's own control variable
``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` (read at ``MPI_Init``, so one job each), and
once more with MPICH's shared-memory path off (``MPIR_CVAR_NOLOCAL=1``: every rank is
treated as remote and talks through the network module). Every job also times the
course's Python ring on the same sizes. It prints, per message size, each run's
median latency side by side, which forced algorithm MPICH's automatic choice is
closest to (an inference from the timings: MPICH does not report its choice), and
the ring's ratio to MPICH's choice. Lessons 03 and 04 show the result.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ALGORITHM_VAR = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"
# MPICH's intra-node allreduce algorithms that run at any rank count on one machine.
ALGORITHMS = ("recursive_doubling", "reduce_scatter_allgather", "ring", "tree")
RUNS = {"auto": {}, **{a: {ALGORITHM_VAR: a} for a in ALGORITHMS},
        "auto, no shared memory": {"MPIR_CVAR_NOLOCAL": "1"}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench mpich-allreduce",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="4M")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    return p


def unavailable() -> str:
    """Why the comparison cannot run here (another MPI than MPICH); empty where it can.

    The MPIR_CVAR_ settings mean nothing to another MPI, which would time one run six times.
    """
    from pcourse.tools.cluster.launch import not_mpich

    why = not_mpich("mpich-allreduce (MPICH's MPIR_CVAR_ algorithm settings)")
    return f"{why} Open MPI's own: `ompi_info --param coll tuned --level 9`." if why else ""


def run_comm(name: str, env: dict[str, str], args: argparse.Namespace, out: Path) -> list[dict]:
    """One ``bench comm`` job (MPI native and the Python ring) under ``env``; its rows."""
    from pcourse.tools.cluster.launch import MPICHOnly

    why = unavailable()
    if why:
        raise MPICHOnly(why)
    cmd = [sys.executable, "-m", "pcourse.tools.bench", "comm", "--ranks", str(args.ranks),
           "--methods", "mpi", "ring", "--min-bytes", args.min_bytes, "--max-bytes",
           args.max_bytes, "--factor", "4", "--timeout", str(args.timeout), "--out", str(out)]
    clean = {k: v for k, v in os.environ.items() if k not in (ALGORITHM_VAR, "MPIR_CVAR_NOLOCAL")}
    done = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=args.timeout + 60)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(cmd)}` failed:\n{done.stderr[-1500:]}")
    with out.open(newline="") as f:
        return [{**r, "run": name} for r in csv.DictReader(f)]


def table(rows: list[dict]) -> list[dict]:
    """Per size: every run's MPI latency (µs), the ring's, MPICH's closest forced choice."""
    by_size: dict[int, dict] = {}
    for r in rows:
        cell = by_size.setdefault(int(r["bytes"]), {"bytes": int(r["bytes"])})
        key = r["run"] if r["method"] == "mpi" else f"ring ({r['run']})"
        cell[key] = float(r["latency_us"])
    for cell in by_size.values():
        auto = cell["auto"]
        forced = {a: cell[a] for a in ALGORITHMS if a in cell}
        cell["closest"] = min(forced, key=lambda a: abs(forced[a] - auto)) if forced else ""
        cell["ring / auto"] = cell.get("ring (auto)", float("nan")) / auto
    return [by_size[k] for k in sorted(by_size)]


SHORT = {"recursive_doubling": "rec_doubling", "reduce_scatter_allgather": "rs_allgather",
         "auto, no shared memory": "auto, no shm"}


def print_table(cells: list[dict]) -> None:
    from pcourse.tools.bench.commreport import human

    runs = list(RUNS)
    print("median latency, µs (MPI_Allreduce in place, float32 sum); ring: MPICH's ring, "
          "forced; py ring: the course's Python ring, same job as 'auto'")
    print(f"{'size':>9}" + "".join(f"{SHORT.get(r, r):>14}" for r in runs)
          + f"{'py ring':>10}{'py ring / auto':>15}  closest forced to auto")
    for c in cells:
        print(f"{human(c['bytes']):>9}" + "".join(f"{c.get(r, float('nan')):>14.1f}" for r in runs)
              + f"{c.get('ring (auto)', float('nan')):>10.1f}{c['ring / auto']:>15.2f}  "
              f"{c['closest']}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    why = unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="pcourse-mpich-") as tmp:
        for i, (name, env) in enumerate(RUNS.items()):
            print(f"[{i + 1}/{len(RUNS)}] {name} "
                  f"{' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
            rows += run_comm(name, env, args, Path(tmp) / f"{i}.csv")
    print_table(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
