"""The scaling command beside the source's own script, timed in one run.

``python -m pcourse.tools.bench versus-source --source PATH/TO/parallel-nn`` runs, in
alternating rounds, three commands and prints each one's wall time, its training
time by its own clock, the torch threads per rank it ran with, its launcher, and the
machine's load:

1. **the source as its users run it** (its README: ``mpiexec -n R python
   main_franke.py --comm mpi --epochs E``, MPICH's usual launcher, hydra, and the
   caller's environment untouched). This is the headline: a comparison that
   handicaps the thing it compares with is not a measurement.
2. the source under the course's launcher (MPICH's single-machine forker), with the
   same torch threads per rank as the course's run, so the two differ only in code;
3. ``python -m pcourse.tools.bench franke --ranks R --epochs E --repeats 1 --backends mpi``.

The threads per rank are measured, not assumed: a probe runs under each row's
launcher and environment and reports ``torch.get_num_threads()`` (hydra and the
forker give ranks different defaults). The source is run from a fresh temporary
copy, so its outputs land there, never copied into the course. Alternating rounds
put a busy machine's noise on all rows alike.

Hydra listens on every interface while row 1 runs, as it does for the source's
users; ``--skip-hydra`` leaves row 1 out where that is not wanted. Rows 2 and 3 listen
nowhere beyond loopback. A SIGTERM to this command ends whichever job runs.
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
from collections.abc import Callable
from pathlib import Path

SOURCE_ENV = "PCOURSE_SOURCE"  # where the source's parallel-nn folder is
# Beside the course folder (the current one), as workshops keep the shared material.
BESIDE = Path("..") / "shared" / "source" / "parallel-nn"


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench versus-source",
                                description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, default=os.environ.get(SOURCE_ENV) or BESIDE,
                   help=f"the source's parallel-nn folder (default: ${SOURCE_ENV}, "
                        "else ../shared/source/parallel-nn from the current folder)")
    p.add_argument("--ranks", type=_positive(int), default=2)
    p.add_argument("--epochs", type=_positive(int), default=20)
    p.add_argument("--rounds", type=_positive(int), default=3, help="alternating runs of each")
    p.add_argument("--timeout", type=_positive(float), default=1800.0,
                   help="seconds per command")
    p.add_argument("--skip-hydra", action="store_true",
                   help="leave out row 1 (hydra listens on every interface while it runs)")
    return p


def course_threads(ranks: int) -> int:
    """Torch threads per rank in the course's Franke run (its config, else init_rank's share)."""
    from pcourse.workloads.config import FrankeConfig

    return FrankeConfig().threads or max(1, (os.cpu_count() or 1) // ranks)


def hydra_env() -> dict[str, str]:
    """The caller's environment, with only the venv's MPI put first on PATH."""
    from pcourse.tools.cluster.launch import find_mpiexec

    mpi_bin = str(Path(find_mpiexec()).parent)
    return {**os.environ, "PATH": f"{mpi_bin}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_hydra(args: argparse.Namespace, program: list[str], cwd: Path | None = None) -> str:
    """``mpiexec -n R python *program`` as a user types it: hydra, the default environment."""
    from pcourse.tools.cluster.launch import MPIJobError, find_mpiexec, run_in_session

    cmd = [find_mpiexec(), "-n", str(args.ranks), sys.executable, *program]
    out, code = run_in_session(cmd, timeout=args.timeout, env=hydra_env(), cwd=cwd)
    if code != 0:
        raise MPIJobError(f"`{' '.join(cmd)}` failed ({code}):\n{out[-2000:]}")
    return out


def run_forker(args: argparse.Namespace, program: list[str], cwd: Path | None = None) -> str:
    """The same under the course's launcher, at the course's threads per rank."""
    from pcourse.tools.cluster.launch import mpirun

    threads = str(course_threads(args.ranks))
    return mpirun(args.ranks, program, timeout=args.timeout, cwd=cwd,
                  env={"OMP_NUM_THREADS": threads}).stdout


PROBE = ["-c", "import torch; print('torch threads', torch.get_num_threads())"]


def probe_threads(run: Callable[..., str], args: argparse.Namespace) -> str:
    """The torch threads each rank gets under ``run``'s launcher and environment."""
    found = sorted(set(re.findall(r"torch threads (\d+)", run(args, PROBE))))
    return "/".join(found) or "?"


def source_round(args: argparse.Namespace, run: Callable[..., str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="pcourse-source-") as tmp:
        copy = Path(tmp) / "parallel-nn"
        shutil.copytree(args.source, copy)
        start = time.perf_counter()
        out = run(args, ["main_franke.py", "--comm", "mpi", "--epochs", str(args.epochs)],
                  cwd=copy)
        wall = time.perf_counter() - start
    took = re.findall(r"Training took: ([0-9.]+) sec", out)
    return {"whole": wall, "train": float(took[0]) if took else float("nan")}


def our_round(args: argparse.Namespace) -> dict:
    from pcourse.tools.cluster.launch import MPIJobError, run_in_session

    with tempfile.TemporaryDirectory(prefix="pcourse-versus-") as tmp:
        cmd = [sys.executable, "-m", "pcourse.tools.bench", "franke", "--ranks", str(args.ranks),
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


def rows(args: argparse.Namespace) -> list[dict]:
    """The rows to run, headline first: name, launcher, command, how to run one round."""
    source_cmd = f"python main_franke.py --comm mpi --epochs {args.epochs}"
    threads = course_threads(args.ranks)
    table = [
        {"name": "source, as its users run it", "launcher": "mpiexec (hydra), default env",
         "command": f"mpiexec -n {args.ranks} {source_cmd}",
         "round": lambda: source_round(args, run_hydra),
         "threads": lambda: probe_threads(run_hydra, args)},
        {"name": "source, course's launcher", "launcher":
            f"mpiexec.gforker, OMP_NUM_THREADS={threads}",
         "command": f"mpiexec.gforker -n {args.ranks} {source_cmd}",
         "round": lambda: source_round(args, run_forker),
         "threads": lambda: probe_threads(run_forker, args)},
        {"name": "pcourse", "launcher": "mpiexec.gforker (pcourse.tools.cluster.launch)",
         "command": f"python -m pcourse.tools.bench franke --ranks {args.ranks} --epochs "
                    f"{args.epochs} --repeats 1 --backends mpi",
         "round": lambda: our_round(args), "threads": lambda: str(threads)},
    ]
    return table[1:] if args.skip_hydra else table


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not (args.source / "main_franke.py").is_file():
        p.error(f"the source's main_franke.py is not in {args.source}; pass --source "
                f"(the parallel-nn folder of NickGeneva/blog-code) or set ${SOURCE_ENV}")
    table = rows(args)
    for row in table:
        row["threads"] = row["threads"]()
        row["runs"] = []
        print(f"{row['name']:<30} {row['command']}\n{'':<30} launcher: {row['launcher']}; "
              f"torch threads per rank: {row['threads']}", flush=True)
    print(f"(the source runs from a temporary copy of {args.source})")
    for i in range(args.rounds):
        for row in table if i % 2 == 0 else table[::-1]:
            r = row["round"]()
            r["load"] = os.getloadavg()[0]
            row["runs"].append(r)
            extra = f", rank job {r['job']:.2f} s" if "job" in r else ""
            print(f"round {i + 1}/{args.rounds} {row['name']:>30}: whole {r['whole']:.2f} s, "
                  f"training {r['train']:.2f} s{extra}   (load average {r['load']:.1f})",
                  flush=True)
    print_summary(table)
    return 0


def _median(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def print_summary(table: list[dict]) -> None:
    """Medians per row, and each source row's ratio to the course's (above 1: course faster)."""
    ours = table[-1]["runs"]
    print(f"\nmedian over {len(ours)} round(s) (min-max), seconds; threads per rank; "
          "ratio = that row / pcourse")
    for label, key in [("whole command", "whole"), ("training, by its own clock", "train")]:
        o = _median(ours, key)
        print(f"\n{label}")
        for row in table:
            m = _median(row["runs"], key)
            ratio = "" if row is table[-1] else f"{m[0] / o[0]:>10.1f}x"
            load = statistics.median(r["load"] for r in row["runs"])
            print(f"  {row['name']:<30}{m[0]:>8.2f} ({m[1]:.1f}-{m[2]:.1f})  threads "
                  f"{row['threads']:>3}  load {load:4.1f}{ratio}")
    for label, key in [("pcourse rank job", "job"), ("pcourse rank job but training", "rest")]:
        o = _median(ours, key)
        print(f"  {label:<30}{o[0]:>8.2f} ({o[1]:.1f}-{o[2]:.1f})")


if __name__ == "__main__":
    sys.exit(main())
