"""Run one rank's program and report how it exited: ``python rank_exit.py PROGRAM...``.

MPICH's single-machine forker notices that its ranks have exited only on a slow
poll, up to about two seconds later. Under this wrapper each rank reports its exit
status itself, on the launcher's kept stdout (file descriptor 3, see
:mod:`pcourse.tools.cluster.launch`), so the job ends as soon as every rank has reported.
The forker's signals are passed on to the rank, which is what the forker meant them
for. Standard library only: it starts in milliseconds.
"""

import os
import signal
import subprocess
import sys

RANK_EXIT = "pcourse-rank-exited"  # then the exit code; 128 + N for a rank killed by signal N
# and, where the launcher said which rank this is, "rank=R": so that whoever reads the
# launcher's output can name the rank that ended first (lesson 14), not only count exits
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # runtime.ranks.MPI_RANK_VARS


def main() -> int:
    rank = subprocess.Popen(sys.argv[1:], stdout=3, stderr=3, close_fds=False)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: rank.send_signal(signum))
    code = rank.wait()
    code = 128 - code if code < 0 else code
    who = next((os.environ[v] for v in _RANK_VARS if v in os.environ), None)
    os.write(3, f"{RANK_EXIT} {code}{f' rank={who}' if who is not None else ''}\n".encode())
    return code


if __name__ == "__main__":
    sys.exit(main())
