"""The scaling command beside the source's own script, timed in one run.

``python -m pcourse.bench versus-source --source PATH/TO/parallel-nn`` runs, in
alternating rounds, the source's ``mpiexec -n R python main_franke.py --comm mpi
--epochs E`` (from a fresh temporary copy, so its outputs land there) and
``python -m pcourse.bench franke --ranks R --epochs E --repeats 1 --backends mpi``,
and prints the whole commands' wall times, each one's training time by its own
clock, our rank job's time without training, and the ratios, with the median and
range over the rounds. The source is run, never copied into the course.
Alternating rounds put a busy machine's noise on both alike; the load average
printed with each round says how busy it was.

Both run as every launcher of the course does (:mod:`pcourse.cluster.launch`): the
source's ranks start as ``mpirun`` starts ours, listening on loopback only, and a
SIGTERM to this command (a closed terminal, a scheduler's stop) ends whichever job runs.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SOURCE_ENV = "PCOURSE_SOURCE"  # where the source's parallel-nn folder is
# Beside the checkout, as workshops keep the shared material (see workloads.mnist).
BESIDE = Path(__file__).resolve().parents[3] / "shared" / "source" / "parallel-nn"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.bench versus-source",
                                description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, default=os.environ.get(SOURCE_ENV) or BESIDE,
                   help=f"the source's parallel-nn folder (default: ${SOURCE_ENV}, "
                        "else shared/source/parallel-nn beside the checkout)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    return p


def source_round(args: argparse.Namespace) -> dict:
    from pcourse.cluster.launch import mpirun

    with tempfile.TemporaryDirectory(prefix="pcourse-source-") as tmp:
        copy = Path(tmp) / "parallel-nn"
        shutil.copytree(args.source, copy)
        start = time.perf_counter()
        out = mpirun(args.ranks, ["main_franke.py", "--comm", "mpi", "--epochs", str(args.epochs)],
                     timeout=args.timeout, cwd=copy).stdout
        wall = time.perf_counter() - start
    took = re.findall(r"Training took: ([0-9.]+) sec", out)
    return {"whole": wall, "train": float(took[0]) if took else float("nan")}


def our_round(args: argparse.Namespace) -> dict:
    from pcourse.cluster.launch import MPIJobError, run_in_session

    with tempfile.TemporaryDirectory(prefix="pcourse-versus-") as tmp:
        cmd = [sys.executable, "-m", "pcourse.bench", "franke", "--ranks", str(args.ranks),
               "--epochs", str(args.epochs), "--repeats", "1", "--backends", "mpi", "--out", tmp]
        start = time.perf_counter()
        out, code = run_in_session(cmd, timeout=args.timeout)
        wall = time.perf_counter() - start
        if code != 0:
            raise MPIJobError(f"`{' '.join(cmd)}` failed ({code}):\n{out[-2000:]}")
        with open(Path(tmp) / "franke_strong_phases.csv", newline="") as f:
            phases = {r["phase"]: float(r["seconds"]) for r in csv.DictReader(f)}
    return {"whole": wall, "train": phases["rank job: training"],
            "job": phases["rank job, mpiexec start to exit"],
            "rest": phases["rank job: everything but training"]}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not (args.source / "main_franke.py").is_file():
        p.error(f"the source's main_franke.py is not in {args.source}; pass --source "
                f"(the parallel-nn folder of NickGeneva/blog-code) or set ${SOURCE_ENV}")
    print(f"source:   mpiexec -n {args.ranks} python main_franke.py --comm mpi "
          f"--epochs {args.epochs}   (in a temporary copy of {args.source})")
    print(f"pcourse:  python -m pcourse.bench franke --ranks {args.ranks} --epochs {args.epochs} "
          "--repeats 1 --backends mpi")
    source, ours = [], []
    for i in range(args.rounds):
        order = [("source", source_round, source), ("pcourse", our_round, ours)]
        for name, fn, into in order if i % 2 == 0 else order[::-1]:
            into.append(fn(args))
            r = into[-1]
            extra = f", rank job {r['job']:.2f} s" if "job" in r else ""
            print(f"round {i + 1}/{args.rounds} {name:>8}: whole {r['whole']:.2f} s, training "
                  f"{r['train']:.2f} s{extra}   (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
    print_summary(source, ours)
    return 0


def _median(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def print_summary(source: list[dict], ours: list[dict]) -> None:
    print(f"\nmedian over {len(ours)} round(s) (min-max), seconds")
    print(f"{'':<36}{'source':>18}{'pcourse':>18}{'source / pcourse':>18}")
    for label, key in [("whole command", "whole"), ("training, by its own clock", "train")]:
        s, o = _median(source, key), _median(ours, key)
        print(f"{label:<36}{s[0]:>8.2f} ({s[1]:.1f}-{s[2]:.1f}){o[0]:>8.2f} ({o[1]:.1f}-{o[2]:.1f})"
              f"{s[0] / o[0]:>17.1f}x")
    for label, key in [("pcourse rank job", "job"), ("pcourse rank job but training", "rest")]:
        o = _median(ours, key)
        print(f"{label:<36}{'':>18}{o[0]:>8.2f} ({o[1]:.1f}-{o[2]:.1f})")


if __name__ == "__main__":
    sys.exit(main())
