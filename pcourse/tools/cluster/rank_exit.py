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


def main() -> int:
    rank = subprocess.Popen(sys.argv[1:], stdout=3, stderr=3, close_fds=False)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: rank.send_signal(signum))
    code = rank.wait()
    code = 128 - code if code < 0 else code
    os.write(3, f"{RANK_EXIT} {code}\n".encode())
    return code


if __name__ == "__main__":
    sys.exit(main())
