"""Run a Python module or script under ``mpiexec`` with a deadline, and reap it.

Tests and benchmarks launch their own MPI jobs; a collective that never completes
must end in a clear timeout, not a CI job that hangs. The job runs in its own
process group so that the deadline kills mpiexec *and* every rank it started, and
a launcher that is itself told to stop (SIGTERM from a closed terminal or a job
scheduler, SIGHUP, Ctrl-C) takes its job down with it.

A job on this machine listens on the loopback interface only: the course runs on
laptops on shared networks. Several nodes are an explicit choice (a hostfile).

Benchmarks relaunch themselves this way and need their results back: the job's
rank 0 calls :func:`report_rows`, the launcher gets them from :func:`mpirun_rows`.
They travel in a file, not in the output, which the ranks' prints and warnings share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcourse.tools.cluster.failures import who_died
from pcourse.tools.cluster.rank_exit import RANK_EXIT
from pcourse.tools.cluster.reaping import sweep_mpi_segments
from pcourse.utils.io import atomic_write

ROWS_ENV = "PCOURSE_ROWS_FILE"  # where report_rows writes; set by mpirun_rows
# Signals that end a launcher from outside; each ends its MPI job first.
SEGMENT_GRACE = 1.0  # seconds a starting job may take to map the segment it created
TERMINATING = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s))
# MPICH's single-machine process manager reports ranks killed by a signal only in
# its output ("[0]1:Return code = 0, signaled with Killed"), not in its exit code.
_SIGNALED = re.compile(r"^\[\d+\]\d+:Return code = \d+, signaled with (\w+)", re.MULTILINE)


class MPINotFound(RuntimeError):
    """No mpiexec to launch with; the message says how to get one."""


def find_mpiexec() -> str:
    """The mpiexec to launch with: the venv's own (pip's mpich) first."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise MPINotFound(
        "mpiexec was not found next to this Python or on PATH. Install an MPI: "
        "`pip install mpich` (the course's `make lab` does this in .venv), or load your "
        "system's MPI module so that `mpiexec` is on PATH."
    )


_FLAVOURS: dict[str, str] = {}


def mpi_flavour(mpiexec: str | None = None) -> str:
    """Whose ``mpiexec`` this is (default :func:`find_mpiexec`'s): ``"mpich"``,
    ``"openmpi"`` or ``"other"`` (Intel MPI, ...), from its ``--version``; asked once.

    The two speak different dialects (hostfiles, running as root, more ranks than
    cores); the MPI library beside mpi4py is the one whose mpiexec this is.
    """
    mpiexec = mpiexec or find_mpiexec()
    if mpiexec not in _FLAVOURS:
        try:
            said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                  timeout=30, stdin=subprocess.DEVNULL)
            text = said.stdout + said.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        _FLAVOURS[mpiexec] = ("openmpi" if "Open MPI" in text or "OpenRTE" in text
                              else "mpich" if "HYDRA" in text or "MPICH" in text else "other")
    return _FLAVOURS[mpiexec]


class MPICHOnly(RuntimeError):
    """A piece of the course that is MPICH's alone was asked for under another MPI."""


def not_mpich(what: str) -> str:
    """Why ``what`` (MPICH's own settings) cannot run here; empty where the MPI is MPICH."""
    flavour = mpi_flavour()
    if flavour == "mpich":
        return ""
    name = {"openmpi": "Open MPI"}.get(flavour, "not MPICH")
    return (f"{what} is MPICH's own, and this MPI is {name} ({find_mpiexec()}); the course's "
            "default setup has MPICH (`make setup`, which installs the mpich wheel).")


def mpich_only(what: str) -> None:
    """MPICHOnly, saying so, unless the MPI here is MPICH."""
    why = not_mpich(what)
    if why:
        raise MPICHOnly(why)


# Open MPI refuses, by default, what MPICH allows: to run as root, and more ranks than cores
# (one slot a core). The course runs both on laptops and in containers, so its Open MPI jobs
# allow them, through the environment (Open MPI 5's PRRTE reads PRTE_MCA_, 4 reads OMPI_MCA_).
OPENMPI_ENV = {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
               "OMPI_MCA_rmaps_base_oversubscribe": "1"}
OPENMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# Ranks on one machine need no network: Open MPI's TCP transport listens on every interface
# whatever btl_tcp_if_include says (seen with 5.0.11), so a job here uses shared memory only.
OPENMPI_ONE_MACHINE = {"OMPI_MCA_btl": "self,sm"}
# Ranks on one machine share its cores, and torch's threads meet at the end of every
# parallel loop. GNU OpenMP (the Linux torch wheels') lets a thread that arrives first spin
# for a long while before it sleeps, which is free only while every thread has a core of its
# own: let anything else run (another rank, a browser, the test suite) and the spinning
# threads take the cores the last thread needs, so the loop waits for a time slice and a
# rank that trains with several threads slows down many times over. A short spin keeps
# the loop as fast on an idle machine and makes it degrade gently on a busy one; a timing
# then measures the program, not what else ran. (OMP_WAIT_POLICY=PASSIVE never spins, and
# costs every loop a sleep and a wake even when idle.)
ONE_MACHINE_ENV = {"GOMP_SPINCOUNT": "3000"}


def flavour_env(flavour: str) -> dict[str, str]:
    """What a job of this MPI needs in its environment to run the course's way."""
    if flavour != "openmpi":
        return {}
    return {**OPENMPI_ENV, **(OPENMPI_ROOT_ENV if os.geteuid() == 0 else {})}


def loopback_env() -> dict[str, str]:
    """Environment that keeps MPI's own network traffic on the loopback interface.

    MPICH's UCX netmod (the pip wheel's default) and Open MPI otherwise open TCP
    listeners on every interface, the machine's external address included. One thing
    stays open under Open MPI 5: its launcher's own out-of-band listener (``prterun``),
    since PRRTE refuses a loopback-only out-of-band network ("No network interfaces
    were found"); its ranks on one machine listen nowhere (:data:`OPENMPI_ONE_MACHINE`).
    MPICH's single-machine launcher listens nowhere, one reason it is the course's default.
    """
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
    return {"UCX_NET_DEVICES": lo, "OMPI_MCA_btl_tcp_if_include": lo,
            "OMPI_MCA_oob_tcp_if_include": lo}


@dataclass(frozen=True)
class Launcher:
    """How to start ranks: ``[*command, "-n", N, *wrap, program...]``, with ``env`` added."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    wrap: list[str] = field(default_factory=list)  # goes before each rank's program


# On this machine every rank runs under pcourse/tools/cluster/rank_exit.py, whichever the MPI:
# it reports the rank's exit status and number on the launcher's output, so that a failed
# job names the rank that ended first (failures.who_died), and one rule names it under both.
_REPORT_EXIT = [sys.executable, "-I", str(Path(__file__).with_name("rank_exit.py"))]
# MPICH's gforker stops forwarding a rank's output at its first non-ASCII byte, and
# closes the pipe (the rank's next write fails). So its ranks write around it: the
# launcher's stdout is kept as fd 3, every rank inherits it and writes there, the report
# too. The forker also notices its ranks' exit only on a slow poll, up to about two
# seconds late: the job ends once every rank has reported. (Open MPI's mpiexec notices at
# once and cleans up after itself as it exits: its job is left to end by itself.)
_KEEP_STDOUT = ["sh", "-c", 'exec 3>&1; exec "$@"', "sh"]
_WRITE_TO_KEPT = [*_REPORT_EXIT, "--out", "3"]


def mpi_launcher(hostfile: str | os.PathLike[str] | None = None) -> Launcher:
    """How to start ranks: on this machine, or (``hostfile``) on the nodes it lists.

    Without ``hostfile`` every rank runs here, nothing listens beyond loopback, and
    OpenMP's threads spin only briefly before they sleep (:data:`ONE_MACHINE_ENV`).
    MPICH's usual launcher (hydra) always listens on all interfaces, for its proxies
    on other nodes, so where MPICH's single-machine launcher (gforker) is installed
    beside it, that starts the ranks instead: it forks them and listens nowhere.
    A ``hostfile`` opts in to several nodes: hydra, ``-f hostfile``, every interface.
    Open MPI's ``mpiexec`` gets its own dialect (``--hostfile``, :func:`flavour_env`).
    Here, each rank runs under :mod:`pcourse.tools.cluster.rank_exit`, which reports its
    exit; a hostfile's ranks run bare (never tried on several nodes).
    """
    mpiexec = find_mpiexec()
    flavour = mpi_flavour(mpiexec)
    if hostfile is not None:
        option = "--hostfile" if flavour == "openmpi" else "-f"
        return Launcher([mpiexec, option, str(hostfile)], flavour_env(flavour))
    here = {**ONE_MACHINE_ENV, **(OPENMPI_ONE_MACHINE if flavour == "openmpi" else {})}
    env = {k: v for k, v in {**loopback_env(), **flavour_env(flavour), **here}.items()
           if k not in os.environ}  # the user's choice wins
    gforker = Path(mpiexec).with_name("mpiexec.gforker")
    if gforker.exists() and shutil.which("sh"):
        return Launcher([*_KEEP_STDOUT, str(gforker)], env, list(_WRITE_TO_KEPT))
    return Launcher([mpiexec], env, list(_REPORT_EXIT))


_contained: list[tuple[list[str], str]] = []  # the probe's answer, once
LAUNCHER_PID = "PCOURSE_LAUNCHER_PID"  # the ranks of a job not in a namespace watch it
PRIVATE_SHM = "4g"  # at most, of memory, for a contained job's /dev/shm (MPICH's segments)

# Only a private /dev/shm (a benchmark's job: its files are the user's to write).
_SHM_ONLY = 'mount -n -t tmpfs -o size=@SHM@,mode=1777 tmpfs /dev/shm && exec "$@"'.replace(
    "@SHM@", PRIVATE_SHM)


def containment() -> tuple[list[str], str]:
    """A prefix that runs a command in a PID namespace of its own; why not, if none.

    ``([...], "")`` where ``unshare`` can make it here (as root; as an ordinary user
    inside a user namespace of its own), else ``([], reason)``. Inside, the command
    and everything it starts see and signal only each other, and die together when the
    command ends or ``unshare`` itself is killed (``--kill-child``). ``/dev/shm`` is
    private too: in a namespace of its own every ``mpiexec`` has the same pid, which names
    MPICH's shared-memory segment, so jobs side by side would otherwise share one.
    Probed once per process.
    """
    if not _contained:
        _contained.append(_probe_containment())
    return _contained[0]


def _probe_containment() -> tuple[list[str], str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return [], "no `unshare` command (util-linux) on this machine"
    prefix = [unshare, "--pid", "--fork", "--mount", "--mount-proc", "--kill-child"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    prefix += ["sh", "-c", _SHM_ONLY, "sh"]
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"`unshare` failed: {exc}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        return [], f"this machine refuses the namespaces ({why})"
    return prefix, ""


def max_engines() -> int:
    """Beyond this many engines a single machine only thrashes; refuse early."""
    return max(8, 4 * (os.cpu_count() or 1), _gpu_count())


def _gpu_count() -> int:
    if "torch" not in sys.modules and not Path("/dev/nvidiactl").exists():
        return 0  # no NVIDIA driver, so no GPU: a launcher need not load torch to know it
    from pcourse.runtime.ranks import gpu_count  # imports torch: only when asked

    return gpu_count()


class MPIJobError(RuntimeError):
    """An MPI job failed or timed out; the message carries its output tail."""

    rows: list[dict[str, Any]] = []  # mpirun_rows: what the job reported before it failed


class MPIResult(subprocess.CompletedProcess):
    """:func:`mpirun`'s result: a completed process, and ``ended``: for a job that failed,
    one line naming the rank that ended first and how, from the exits its ranks reported
    (:func:`pcourse.tools.cluster.failures.who_died`; empty on a hostfile's nodes, whose
    ranks run without the wrapper that reports them)."""

    ended: str = ""


def mpirun(
    n: int,
    args: Sequence[str],
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    echo: Callable[[str], object] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    contain: bool = False,
) -> MPIResult:
    """Run ``python *args`` on n MPI ranks; return its completed process (text output;
    ``ended`` names the rank that ended first where the job failed).

    ``args`` follow the Python interpreter: ``["-m", "pcourse.tools.bench.commbench", ...]`` or
    ``["path/to/script.py", ...]``. ``echo`` gets each line of output as it comes
    (a long benchmark shows its progress), and the output is still returned.
    ``hostfile`` spreads the ranks over the nodes it lists (see :func:`mpi_launcher`);
    without it they run here, on loopback.

    ``contain=True`` (a command line's job, here): the job dies with this process,
    however it ends, SIGKILL included: ``mpiexec`` gets SIGKILL when its parent dies
    (``setpriv --pdeathsig``), and in a PID namespace of its own (:func:`containment`)
    its end is every rank's end. Without a namespace, the ranks of :mod:`pcourse.tools.bench`
    watch the launcher themselves (``$PCOURSE_LAUNCHER_PID``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be at least 1 rank, got {n!r}")
    launcher = mpi_launcher(hostfile)
    full_env = dict(os.environ)
    mpi_bin = Path(find_mpiexec()).parent
    full_env["PATH"] = f"{mpi_bin}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.update(launcher.env)
    full_env.update(env or {})
    cmd = [*launcher.command, "-n", str(n), *launcher.wrap, sys.executable, *args]
    if contain and hostfile is None:
        prefix = containment()[0]
        if not prefix:
            full_env[LAUNCHER_PID] = str(os.getpid())
        setpriv = shutil.which("setpriv")
        cmd = [*([setpriv, "--pdeathsig", "KILL"] if setpriv else []), *prefix, *cmd]
    exits: list[str] = []
    out, code = run_in_session(cmd, timeout=timeout, env=full_env, cwd=cwd, echo=echo,
                               ranks=n if launcher.wrap == _WRITE_TO_KEPT else None,
                               exits=exits)
    killed = _SIGNALED.findall(out or "")
    if code == 0 and killed:
        code = 128 + getattr(signal, f"SIG{killed[0].upper()}", signal.SIGKILL)
    result = MPIResult(cmd, code, out, "")
    result.ended = who_died("".join(exits)) if code != 0 else ""
    if check and code != 0:
        first = f" ({result.ended})" if result.ended else ""
        raise MPIJobError(f"`{' '.join(cmd)}` exited with code {code}{first}. Output tail:\n"
                          f"{_tail(out)}")
    return result


def run_in_session(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    echo: Callable[[str], object] | None = None,
    ranks: int | None = None,
    exits: list[str] | None = None,
) -> tuple[str, int]:
    """Run a launcher command in a session of its own; return its output and exit code.

    Whatever ends it ends everything it started: its exit, the deadline (then
    MPIJobError, with the output tail), an error here, or SIGTERM/SIGHUP to this
    process (:func:`ends_with_launcher`). ``echo`` as in :func:`mpirun`. With
    ``ranks``, the job is over once that many RANK_EXIT lines came (the exit code is
    then the ranks' worst), without waiting for the launcher to notice; ``exits``, a list,
    gets those lines, in the order they came.
    """
    sweep_mpi_segments()  # a dead job's segment must not meet this one's ranks
    with ends_with_launcher():
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a rank cut off mid-character must not cost the rest
            env=env,
            cwd=cwd,
            start_new_session=True,  # own process group: the deadline reaps every rank
        )
        code: int | None = 1  # until the job says otherwise, it failed
        try:
            out, code = _collect(proc, timeout, echo, ranks, exits)
        except subprocess.TimeoutExpired as expired:
            out = expired.output or ""
            raise MPIJobError(
                f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s and was killed. "
                f"Output tail:\n{_tail(out)}"
            ) from None
        finally:
            kill_group(proc, grace=2.0)
            if (proc.returncode if code is None else code) != 0:
                # What killed ranks left: the sweep spares segments younger than a
                # starting job's window, and a job that ended early may be younger.
                time.sleep(SEGMENT_GRACE)
            sweep_mpi_segments(min_age=SEGMENT_GRACE)
    return out, proc.returncode if code is None else code


def _collect(proc: subprocess.Popen, timeout: float, echo: Callable[[str], object] | None,
             ranks: int | None = None, exits: list[str] | None = None
             ) -> tuple[str, int | None]:
    """The job's whole output, and the ranks' exit code when ``ranks`` reported one each.

    With ``echo``, each line also goes there as it arrives. On the deadline the job
    gets SIGINT first, so that the launcher passes on what the ranks printed before
    it goes, and TimeoutExpired carries that output.
    """
    lines: list[str] = []
    codes: list[int] = []
    all_exited = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None  # the job is started with stdout=PIPE
        for line in proc.stdout:
            # A rank whose output did not end its last line (print(..., end="")) gets
            # the marker glued to it: the rank's text is kept, on a line of its own.
            said, marker, code = line.partition(RANK_EXIT)
            if marker:
                codes.append(int(code.split()[0]))
                if exits is not None:
                    exits.append(marker + code)
                if ranks is not None and len(codes) >= ranks:
                    all_exited.set()
                if not said:
                    continue
                line = said + "\n"
            lines.append(line)
            if echo is not None:
                echo(line.rstrip("\n"))
        all_exited.set()  # end of output: the launcher and every rank are gone

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if not all_exited.wait(timeout=timeout):
        kill_group(proc, grace=2.0)
        reader.join()
        raise subprocess.TimeoutExpired(proc.args, timeout, "".join(lines))
    if ranks is not None and len(codes) >= ranks and proc.poll() is None:
        _kill_stragglers(proc.pid)  # only the launcher's wait is left: end it now
        proc.wait()
        reader.join()
        return "".join(lines), max(codes, key=abs)
    proc.wait()
    reader.join()
    return "".join(lines), None


def mpirun_rows(
    n: int, args: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
    echo: Callable[[str], object] | None = None, contain: bool = False,
    on_rows: Callable[[list[dict[str, Any]]], object] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Run a job whose rank 0 calls :func:`report_rows`; return (its rows, its output).

    MPIJobError if the job fails, times out or ends without reporting; its ``rows``
    are what the job had reported before it failed (a job may report as it goes).
    ``on_rows(rows)`` hears of each new report as it comes (after a line of output),
    so the caller can keep them on disk; ``contain`` as in :func:`mpirun`.
    """
    with tempfile.TemporaryDirectory(prefix="pcourse-rows.") as tmp:
        path = Path(tmp) / "rows.json"
        seen = [0.0]

        def echoed(line: str) -> None:
            if echo is not None:
                echo(line)
            try:
                changed = path.stat().st_mtime_ns
            except OSError:
                return
            if on_rows is not None and changed != seen[0]:
                seen[0] = changed
                on_rows(json.loads(path.read_text()))

        try:
            proc = mpirun(n, args, timeout=timeout, env={**(env or {}), ROWS_ENV: str(path)},
                          echo=echoed if (echo or on_rows) else None, contain=contain)
        except MPIJobError as exc:
            exc.rows = json.loads(path.read_text()) if path.exists() else []
            raise
        if not path.exists():
            raise MPIJobError(f"`{' '.join(proc.args)}` finished but reported no results. "
                              f"Output tail:\n{_tail(proc.stdout)}")
        return json.loads(path.read_text()), proc.stdout


def report_rows(rows: list[dict[str, Any]]) -> bool:
    """Hand ``rows`` to the :func:`mpirun_rows` that launched this job (call on one rank).

    False, and nothing written, when no mpirun_rows launched it (the user's own
    mpiexec): the caller then reports the rows itself.
    """
    if ROWS_ENV not in os.environ:
        return False
    with atomic_write(os.environ[ROWS_ENV]) as f:
        json.dump(rows, f)
    return True


def kill_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """End a process started with ``start_new_session=True`` and everything it started.

    With ``grace``, the group first gets SIGINT (pytest and Jupyter shut their kernels
    and clusters down on it) and that many seconds to exit; then SIGKILL for what is left.
    """
    if proc.poll() is not None:
        _kill_stragglers(proc.pid)
        return
    if grace > 0:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    _kill_stragglers(proc.pid)
    proc.wait()


def _kill_stragglers(pgid: int) -> None:
    """SIGKILL what is left of a process group (ranks outlive a launcher that exited)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def ends_with_launcher() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP end this process the way Ctrl-C does.

    By default they kill Python on the spot, skipping ``finally`` blocks, so a
    launcher's MPI job (in a session of its own, out of the terminal's reach)
    would run on, orphaned. Here they raise SystemExit instead, and the cleanup
    around the job runs. Signals can only be handled in the main thread; elsewhere
    (and for signals this process ignores) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _tail(text: str | None, lines: int = 40) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:]) or "(no output)"
