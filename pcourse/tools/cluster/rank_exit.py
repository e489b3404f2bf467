"""Run one rank's program and report how it exited: ``python rank_exit.py [--out FD] PROGRAM...``.

Every rank a launcher starts on this machine runs under it (MPICH's and Open MPI's
alike, :func:`pcourse.tools.cluster.launch.mpi_launcher`), so that whoever reads the
launcher's output can name the rank that ended first (lesson 14), not only see that
the job failed: the report says the rank and its exit status, and a rank killed by a
signal is reported by its wrapper, which outlives it.

The report goes to the launcher's output: the rank's own stdout, which the launcher
forwards (Open MPI, MPICH's hydra), or ``--out FD``, a file descriptor the rank
inherited. MPICH's single-machine forker needs the latter: it stops forwarding a rank's
output at its first non-ASCII byte, so its ranks write to the launcher's kept stdout
(file descriptor 3, see :mod:`pcourse.tools.cluster.launch`), and since it notices its
ranks' exits only on a slow poll, up to about two seconds late, the job ends as soon as
every rank has reported. The launcher's signals are passed on to the rank, which is what
the launcher meant them for. Standard library only: it starts in milliseconds.
"""

import os
import signal
import subprocess
import sys

RANK_EXIT = "pcourse-rank-exited"  # then the exit code; 128 + N for a rank killed by signal N
# and, where the launcher said which rank this is, "rank=R"
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # runtime.ranks.MPI_RANK_VARS


def main(argv: list[str]) -> int:
    out = None  # the rank writes where this wrapper does, and the report goes to stdout
    if argv[:1] == ["--out"]:
        out, argv = int(argv[1]), argv[2:]
    rank = subprocess.Popen(argv, stdout=out, stderr=out, close_fds=False)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: rank.send_signal(signum))
    code = rank.wait()
    code = 128 - code if code < 0 else code
    who = next((os.environ[v] for v in _RANK_VARS if v in os.environ), None)
    report = f"{RANK_EXIT} {code}{f' rank={who}' if who is not None else ''}\n"
    os.write(1 if out is None else out, report.encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
