"""Lesson 14's run restarted by torch's own launcher: ``torchrun --max-restarts``.

:func:`launch` starts ``torchrun --standalone --nproc-per-node p --max-restarts R`` on
:func:`worker`: p ranks of :func:`pcourse.tools.bench.restart.run` on Gloo (meeting on
torchrun's store), saving a :mod:`pcourse.resume` checkpoint every ``every`` steps. On
torchrun's first attempt one rank kills itself with SIGKILL before a chosen step;
torchrun's agent sees a worker fail, stops the others and starts the whole group again,
saying so in its log at level INFO (:data:`RESTARTED`; ``LOGLEVEL=INFO`` shows it). Each
worker knows its attempt from torchrun itself (``TORCHELASTIC_RESTART_COUNT``, which the
agent sets), never from a file of ours: on attempt 0 the chosen rank dies, on any other
nobody does. Every attempt resumes from
the newest complete checkpoint where there is one, as a restarted job does; the one that
finishes then trains the same run never interrupted and writes each rank's comparison
(:func:`pcourse.tools.bench.restart.compare`) to ``--out``, one JSON file a rank.

torch 2.13's agent hands every attempt the same store, the last attempt's keys in it: a
group restarted on it through ``env://`` hung here in Gloo's connect, so (:func:`_join`)
each attempt's ranks meet under a prefix of their attempt. Nothing outlives :func:`launch`:
torchrun runs in a session of its own with a deadline, and each worker (in a session
torchrun made) leaves when the agent that started it is gone (:func:`_leave_with_agent`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from pcourse.tools.cluster.launch import MPIJobError, run_in_session
from pcourse.utils.io import atomic_write

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's agent in every worker
# torchrun's agent, on a failed worker group it restarts (torch.distributed.elastic's api.py)
RESTARTED = re.compile(r"Worker group (?:FAILED|UNHEALTHY)\. \d+/\d+ attempts left; "
                       r"will restart worker group")


def _resumable(root: str) -> str | None:
    """``root`` where it holds a complete checkpoint (a restarted job's), else None."""
    from pcourse import resume

    try:
        resume.latest(root)
    except resume.CheckpointError:
        return None
    return root


def _join(attempt: int, timeout: float) -> None:
    """torch.distributed's default group, on torchrun's store under this attempt's prefix
    (its agent serves the store: ``TORCHELASTIC_USE_AGENT_STORE``, as under --standalone)."""
    from datetime import timedelta

    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)


def _leave_with_agent(poll: float = 0.5) -> None:
    """Exit when torchrun's agent, this worker's parent, is gone (killed at a deadline)."""
    import threading
    import time

    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll)
        os._exit(137)  # nobody is left to read what this rank would report

    threading.Thread(target=watch, daemon=True, name="pcourse-agent-watch").start()


def worker(argv: list[str] | None = None) -> int:
    """One rank under torchrun (``python -m pcourse.tools.bench.elastic``; see the module)."""
    import argparse

    from pcourse.backends import make_backend
    from pcourse.tools.bench import restart

    parser = argparse.ArgumentParser(prog="python -m pcourse.tools.bench.elastic")
    parser.add_argument("--root", required=True, help="where the checkpoints go")
    parser.add_argument("--out", required=True, help="where each rank's comparison goes")
    parser.add_argument("--kill", nargs=2, type=int, metavar=("RANK", "STEP"), required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--forget", nargs="*", default=[], choices=["rng", "position",
                        "optimizer"], help="what the resume leaves out (a wrong resume)")
    parser.add_argument("--deadline", type=float, default=30.0,
                        help="seconds a collective waits for a missing rank")
    args = parser.parse_args(argv)
    _leave_with_agent()
    attempt = int(os.environ[RESTART_COUNT])
    _join(attempt, args.deadline)
    with make_backend("gloo", timeout=args.deadline) as backend:
        kill = (*args.kill, "compute") if attempt == 0 else None
        resumed = restart.run(backend, args.steps, root=args.root, every=args.every,
                              resume_from=_resumable(args.root), kill_at=kill,
                              forget=args.forget)
        reference = restart.run(backend, args.steps)  # never interrupted
        said = {"rank": backend.rank, "attempt": attempt, "said": resumed["said"],
                **restart.compare(reference, resumed)}
        with atomic_write(Path(args.out) / f"rank{backend.rank:05d}.json") as f:
            json.dump(said, f)
    return 0


def launch(p: int, root: str, out: str, kill: tuple[int, int], *, steps: int = 12,
           every: int = 5, max_restarts: int = 1, forget: tuple[str, ...] = (),
           timeout: float = 120.0) -> tuple[str, list[dict[str, Any]]]:
    """Run :func:`worker` on ``p`` ranks under ``torchrun --max-restarts``; rank
    ``kill[0]`` dies before step ``kill[1]`` on the first attempt; ``forget``: what each
    resume leaves out (:func:`pcourse.resume.load`'s). Returns torchrun's output and each
    rank's comparison (rank order). MPIJobError if torchrun does not end within
    ``timeout`` s (then it and every worker are killed) or fails."""
    Path(out).mkdir(parents=True, exist_ok=True)
    script = Path(sys.executable).with_name("torchrun")  # torch.distributed.run's
    torchrun = [str(script)] if script.exists() else [sys.executable, "-m",
                                                      "torch.distributed.run"]
    cmd = [*torchrun, "--standalone", "--nproc-per-node", str(p), "--max-restarts",
           str(max_restarts), "-m", "pcourse.tools.bench.elastic", "--root", root, "--out",
           out, "--kill", *map(str, kill), "--steps", str(steps), "--every", str(every),
           *(["--forget", *forget] if forget else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}  # INFO: its restarts
    text, code = run_in_session(cmd, timeout=timeout, env=env)
    if code != 0:
        raise MPIJobError(f"torchrun exited with code {code}. Its output:\n{text[-4000:]}")
    found = sorted(Path(out).glob("rank*.json"))
    return text, [json.loads(f.read_text()) for f in found]


if __name__ == "__main__":
    sys.exit(worker())
