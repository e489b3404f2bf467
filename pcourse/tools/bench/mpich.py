"""Which allreduce MPICH runs, and why a Python ring can beat it on one machine.

``python -m pcourse.tools.bench mpich-allreduce --ranks 2`` runs ``pcourse.tools.bench comm``
once per MPICH allreduce algorithm, forcing each with MPICH's own control variable
``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` (read at ``MPI_Init``, so one job each), and
once more with MPICH's shared-memory path off (``MPIR_CVAR_NOLOCAL=1``: every rank is
treated as remote and talks through the network module), and once with its automatic
choice made without the device's own collectives (``MPIR_CVAR_ALLREDUCE_DEVICE_COLLECTIVE=0``:
only MPICH's generic algorithms, the level at which a forced algorithm is chosen). Every
job also times the course's Python ring on the same sizes. It prints, per message size,
each run's median latency side by side, and which forced algorithms each automatic
choice matches (an inference from the timings: MPICH does not report its choice):
within :data:`MATCH` of its median, their quartiles overlapping; none, where none does.
Lessons 03 and 04 show the result.
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
DEVICE_VAR = "MPIR_CVAR_ALLREDUCE_DEVICE_COLLECTIVE"
RUNS = {"auto": {}, **{a: {ALGORITHM_VAR: a} for a in ALGORITHMS},
        "auto, no shared memory": {"MPIR_CVAR_NOLOCAL": "1"},
        "auto, no device collectives": {DEVICE_VAR: "0"}}
AUTOS = ("auto", "auto, no device collectives")  # the automatic choices matched to a forced one
MATCH = 0.15  # a forced algorithm "matches" within 15% of the median, quartiles overlapping


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
    clean = {k: v for k, v in os.environ.items()
             if k not in (ALGORITHM_VAR, "MPIR_CVAR_NOLOCAL", DEVICE_VAR)}
    done = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=args.timeout + 60)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(cmd)}` failed:\n{done.stderr[-1500:]}")
    with out.open(newline="") as f:
        return [{**r, "run": name} for r in csv.DictReader(f)]


def table(rows: list[dict]) -> list[dict]:
    """Per size: every run's MPI latency (µs) and quartiles, the ring's, and the forced
    algorithms each automatic choice matches (:func:`matches`)."""
    by_size: dict[int, dict] = {}
    for r in rows:
        cell = by_size.setdefault(int(r["bytes"]), {"bytes": int(r["bytes"])})
        key = r["run"] if r["method"] == "mpi" else f"ring ({r['run']})"
        cell[key] = float(r["latency_us"])
        cell[key + " q"] = (float(r["p25_us"]), float(r["median_us"]), float(r["p75_us"]))
    for cell in by_size.values():
        for auto in AUTOS:
            if auto in cell:
                cell[f"matches {auto}"] = matches(cell, auto)
        cell["ring / auto"] = cell.get("ring (auto)", float("nan")) / cell["auto"]
    return [by_size[k] for k in sorted(by_size)]


def matches(cell: dict, run: str) -> list[str]:
    """The forced algorithms whose median is within :data:`MATCH` of ``run``'s and whose
    interquartile range overlaps it, nearest first: none, where the automatic choice ran
    something no forced algorithm reproduces."""
    lo, mid, hi = cell[run + " q"]
    found = [(abs(cell[a] - mid), a) for a in ALGORITHMS if a in cell
             and abs(cell[a] - mid) <= MATCH * mid
             and cell[a + " q"][0] <= hi and lo <= cell[a + " q"][2]]
    return [a for _, a in sorted(found)]


SHORT = {"recursive_doubling": "rec_doubling", "reduce_scatter_allgather": "rs_allgather",
         "auto, no shared memory": "auto, no shm", "auto, no device collectives": "auto, no dev"}


def print_table(cells: list[dict]) -> None:
    from pcourse.tools.bench.commreport import human

    runs = [r for r in RUNS if any(r in c for c in cells)]  # the runs made (a lesson may skip one)
    print("median latency, µs (MPI_Allreduce in place, float32 sum); ring: MPICH's ring, "
          "forced; py ring: the course's Python ring, same job as 'auto'")
    print(f"{'size':>9}" + "".join(f"{SHORT.get(r, r):>14}" for r in runs)
          + f"{'py ring':>10}{'py ring / auto':>15}")
    for c in cells:
        print(f"{human(c['bytes']):>9}" + "".join(f"{c.get(r, float('nan')):>14.1f}" for r in runs)
              + f"{c.get('ring (auto)', float('nan')):>10.1f}{c['ring / auto']:>15.2f}")
    print(f"forced algorithms each automatic choice matches (within {MATCH:.0%} of its median, "
          "the quartiles overlapping):")
    for c in cells:
        print(f"{human(c['bytes']):>9}  " + "; ".join(
            f"{SHORT.get(a, a)}: {', '.join(SHORT.get(m, m) for m in c[f'matches {a}']) or 'none'}"
            for a in AUTOS if f"matches {a}" in c))


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
