"""A one-node Slurm on this machine, started and stopped by the tests (``slurm`` fixture).

Debian's ``slurm-wlm`` and ``munge`` (``apt-get install slurm-wlm munge``, as root:
``.ci/run`` does it). Everything lives in one temporary folder: a fresh munge key and
``munged`` on a socket of its own, a ``slurm.conf`` written for this machine, and
``slurmctld`` and ``slurmd`` in the foreground as children of the test process, on
free ports, so that stopping them is killing our own processes and nothing of the
system's (``/etc/slurm``, ``/run/munge``) is read or touched. Commands reach this
Slurm through ``SLURM_CONF``.

The node claims more CPUs than the machine has (``SlurmdParameters=config_overrides``):
the engines of a lesson, like ``mpiexec`` here, may outnumber the cores. Two partitions:
``debug`` (the default) and ``held``, which is down, so a job sent there waits in the
queue for ever, with Slurm's reason ``PartitionDown``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
PARTITION, HELD = "debug", "held"
NODE_CPUS = 8
START_TIMEOUT = 60.0  # seconds for the node to be IDLE (a loaded 2-core machine is slow)
REQUIRE = "PCOURSE_REQUIRE_SLURM"  # 1: a missing Slurm fails the tests instead of skipping
INSTALL = "as root: apt-get install slurm-wlm munge (Debian, Ubuntu); .ci/run does it"

CONF = """\
ClusterName=pcourse
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=300
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName={held} Nodes=ALL MaxTime=INFINITE State=DOWN
"""


def unavailable() -> str:
    """Why no one-node Slurm can be started here; empty if it can."""
    lacking = [c for c in (*DAEMONS, *CLIENTS) if not _which(c)]
    if lacking:
        return f"no {', '.join(lacking)} on this machine ({INSTALL})"
    if os.geteuid() != 0:
        return "the one-node Slurm runs its daemons as root, and this is not root"
    return ""


def _which(command: str) -> str | None:
    return shutil.which(command, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneNodeSlurm:
    """slurmctld + slurmd + munged in ``folder``; :meth:`start`, then :meth:`stop`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.host = socket.gethostname().split(".")[0]
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        """Start the daemons and wait (with a deadline) until the node is IDLE."""
        self.folder.chmod(0o755)  # munged wants its socket's folder reachable by all
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.conf.write_text(CONF.format(
            host=self.host, dir=self.folder, ctld_port=_free_port(), d_port=_free_port(),
            cpus=NODE_CPUS, partition=PARTITION, held=HELD))
        f = self.folder
        self._daemon([_which("munged"), "--foreground", "--force", f"--key-file={key}",
                      f"--socket={f}/munge.socket", f"--pid-file={f}/munged.pid",
                      f"--log-file={f}/munged.log", f"--seed-file={f}/munged.seed"])
        self._wait(lambda: (f / "munge.socket").exists(), "munged's socket")
        self._daemon([_which("slurmctld"), "-D", "-i"])
        self._daemon([_which("slurmd"), "-D"])
        self._wait(lambda: self.node_state() == "idle", "the node to be idle (sinfo)")

    def _daemon(self, cmd: list[str | None]) -> None:
        log = open(self.folder / f"{Path(str(cmd[0])).name}.out", "w")  # noqa: SIM115 - the daemon's, kept
        self.daemons.append(subprocess.Popen(
            [str(c) for c in cmd], env=self.env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"{', '.join(dead)} exited" if dead else f"no {what} in {START_TIMEOUT} s"
                raise RuntimeError(f"the one-node Slurm did not start: {why}. Logs:\n"
                                   + self.logs())
            time.sleep(0.2)

    def node_state(self) -> str:
        """sinfo's state of the node: idle, mixed, alloc, down, ... ('' if none yet)."""
        done = self.run("sinfo", "--noheader", "--nodes", self.host, "--format", "%t",
                        check=False)
        return done.stdout.strip().split("\n")[0].rstrip("*~#") if done.returncode == 0 else ""

    def run(self, *args: str, check: bool = True, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this Slurm."""
        return subprocess.run([_which(args[0]) or args[0], *args[1:]], env=self.env,
                              capture_output=True, text=True, check=check, timeout=timeout)

    def queue(self) -> list[str]:
        """``squeue``'s lines (job id, state, reason) for every job this Slurm still lists."""
        out = self.run("squeue", "--noheader", "--format", "%i %T %r", check=False).stdout
        return [line for line in out.splitlines() if line.strip()]

    def logs(self) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.out",
                     "slurmctld.out", "slurmd.out"):
            path = self.folder / name
            if path.exists():
                tail = path.read_text(errors="replace").strip().splitlines()[-15:]
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, end the daemons, then anything left that carries this Slurm's
        ``SLURM_CONF`` (the daemons, slurmstepd and the jobs' tasks all inherit it)."""
        from pcourse.tools.cluster.reaping import kill_marked

        if self.daemons and all(d.poll() is None for d in self.daemons):
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 20
            while self.queue() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in reversed(self.daemons):  # slurmd, slurmctld, munged
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons.clear()
        kill_marked(str(self.conf), grace=2.0, variable="SLURM_CONF")
