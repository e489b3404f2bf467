"""The jail a graded learner's code runs in: bubblewrap, an unprivileged id, a seccomp filter.

A learner's grading job (:mod:`pcourse.tools.grading.job`: its MPI ranks, ``mpiexec`` and
anything they start) runs inside :func:`prefix`, and each rank's learner process
(:func:`start_workers`) in a jail of the same kind of its own, which

- maps them to an unprivileged id (as root: bubblewrap keeps CAP_SETUID and CAP_SETGID
  only long enough for ``setpriv`` to become uid/gid :data:`UID` with no groups; as an
  ordinary user: a user namespace of bubblewrap's, uid :data:`UID` inside, the user's
  own id outside), with no capabilities and ``no_new_privs``;
- gives them namespaces of their own: mount, PID (they see and signal only each
  other; all die with bubblewrap), network (a loopback of their own: the ranks reach the
  grader, and each learner process its rank, through a unix socket), IPC, UTS;
- gives them an environment of their own: none of the grader's variables, only what
  Python and MPI need (:func:`pcourse.tools.grading.job._environment`);
- shows them a root of their own: read-only, the system's programs and libraries,
  a few files of ``/etc`` (not ``shadow``), the Python and the venv, the taught
  package (``pcourse/`` alone: no ``solutions/``, ``tests/``, ``.git``, no other
  learner, no output folder, no file of the grader's); writable, a private
  ``/tmp`` and ``/dev/shm`` (size-limited tmpfs, gone with them) and the folder of
  the sockets they listen or connect at;
- filters system calls (:func:`seccomp_program`, a classic BPF program written
  here: no new dependency): mount and its kin, ``umount``, ``pivot_root``,
  ``chroot``, ``ptrace``, ``setns``, ``unshare`` and ``clone`` of any new namespace,
  loading kernel code, ``bpf``, ``perf_event_open``, keyrings, ``userfaultfd``
  fail with EPERM; a 32-bit system call on a 64-bit machine kills the process;
- and runs under resource limits (:data:`LIMITS`: processes, address space per
  process, file size, CPU seconds per process; rlimits, set by ``prlimit``), and, where
  the grader may make cgroups, under limits of the jail as a whole
  (:data:`CGROUP_LIMITS`: memory, processes).

Where bubblewrap is missing (:func:`available` says why) the class grader refuses to
run; a learner grading their own notebooks, and Gradescope's autograder (whose container
is the jail), run the same job unjailed, and every row says so
(:func:`pcourse.tools.grading.grade.isolation_notes`).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

UID = 65534  # nobody: the id learner code runs as
# rlimits of every process in the jail. Processes count every thread of the jail's
# uid on the machine, every worker's jail together (as an ordinary user: all the
# user's, so it is added to what runs now); torch starts a thread per core in each
# learner process, hence per core. Memory is address space per process (torch reserves a few
# GiB); CPU seconds per process, for all of one learner's notebooks.
LIMITS = {"nproc": max(1024, 256 * (os.cpu_count() or 1)), "as": 16 << 30,
          "fsize": 256 << 20, "cpu": 1800, "core": 0}
# And of each jail as a whole (one learner's job: its ranks, mpiexec, everything
# they start), where the machine lets the grader make cgroups (:func:`cgroups`): memory
# (tmpfs pages included: /tmp, /dev/shm) and processes (threads count). Four ranks
# with torch need a small part of either.
CGROUP_LIMITS = {"memory": 8 << 30, "pids": 4096}
CGROUP_FILES = {1: {"memory": "memory.limit_in_bytes", "pids": "pids.max"},
                2: {"memory": "memory.max", "pids": "pids.max"}}
CGROUPS = Path("/sys/fs/cgroup")
TMP_SIZE = 1 << 30  # bytes of the jail's /tmp
SHM_SIZE = 4 << 30  # and of its /dev/shm (MPICH's shared-memory segments)
ETC = ("passwd", "group", "hosts", "nsswitch.conf", "ld.so.cache", "ld.so.conf",
       "ld.so.conf.d", "localtime", "alternatives", "host.conf")
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def bwrap() -> str | None:
    return shutil.which("bwrap")


def available() -> tuple[bool, str]:
    """Can learner code be jailed here? ``(True, "")``, else ``(False, why)``."""
    if sys.platform != "linux":
        return False, "bubblewrap runs on Linux only"
    if bwrap() is None:
        return False, ("bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: "
                       "apt-get install bubblewrap)")
    if shutil.which("prlimit") is None or (os.geteuid() == 0 and not shutil.which("setpriv")):
        return False, "util-linux's `prlimit`/`setpriv` are missing"
    if seccomp_program() is None:
        return False, f"no seccomp filter written for {platform.machine()}"
    return True, ""


# ---------------------------------------------------------------- seccomp, by hand

# (audit arch, {name: number}) per machine; numbers from the kernel's syscall tables.
_COMMON = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
           "fsmount": 432, "fspick": 433, "mount_setattr": 442}
_ARCH = {
    "x86_64": (0xC000003E, {"mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
                            "ptrace": 101, "setns": 308, "unshare": 272, "kexec_load": 246,
                            "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
                            "delete_module": 176, "bpf": 321, "perf_event_open": 298,
                            "keyctl": 250, "add_key": 248, "request_key": 249,
                            "userfaultfd": 323, "swapon": 167, "swapoff": 168, "reboot": 169,
                            "acct": 163, **_COMMON}, 56),
    "aarch64": (0xC00000B7, {"mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
                             "ptrace": 117, "setns": 268, "unshare": 97, "kexec_load": 104,
                             "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
                             "delete_module": 106, "bpf": 280, "perf_event_open": 241,
                             "keyctl": 219, "add_key": 217, "request_key": 218,
                             "userfaultfd": 282, "swapon": 224, "swapoff": 225, "reboot": 142,
                             "acct": 89, **_COMMON}, 220),
}
CLONE3 = 435  # refused with ENOSYS: its flags are in memory a filter cannot read; libc
#               then falls back to clone, whose flags it can
CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The jail's filter, as the ``struct sock_filter`` array bubblewrap's ``--seccomp`` reads.

    None on a machine without a table above. Layout: check the architecture (else
    kill), refuse x32 numbers, refuse each listed call, check clone's flags, allow.
    """
    arch = _ARCH.get(machine or platform.machine())
    if arch is None:
        return None
    audit, calls, clone = arch
    denied = sorted(set(calls.values()))
    code: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, 4), (_JEQ, 1, 0, audit), (_RET, 0, 0, _KILL), (_LD_W_ABS, 0, 0, 0)]
    # then: one check per denied call (x32 numbers first), clone3, clone, and the tail
    denies = [(_JGE, 0x40000000), *((_JEQ, nr) for nr in denied)]
    first = len(code)
    clone3_at = first + len(denies)
    allow, enosys, deny = clone3_at + 4, clone3_at + 5, clone3_at + 6
    for i, (op, k) in enumerate(denies):
        code.append((op, deny - (first + i) - 1, 0, k))
    code.append((_JEQ, enosys - clone3_at - 1, 0, CLONE3))
    code.append((_JEQ, 0, allow - (clone3_at + 1) - 1, clone))  # not clone: allow
    code.append((_LD_W_ABS, 0, 0, 16))  # clone's flags: the low half of args[0]
    code.append((_JSET, deny - (clone3_at + 3) - 1, 0, CLONE_NEW))
    code.append((_RET, 0, 0, _ALLOW))
    code.append((_RET, 0, 0, _ERRNO | ENOSYS))
    code.append((_RET, 0, 0, _ERRNO | EPERM))
    assert len(code) == deny + 1 and deny - first < 256
    return b"".join(struct.pack("=HBBI", *ins) for ins in code)


# ---------------------------------------------------------------- the view

def _package() -> Path:
    """The folder of the ``pcourse`` package (not the course folder holding it)."""
    return Path(__file__).resolve().parents[2]


def _pythons() -> list[Path]:
    """What the jail's Python needs: the venv, its base Python, the executable's folder."""
    found = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parents[1]}
    return sorted(p.resolve() for p in found)


def view(extra: Sequence[Path] = ()) -> list[str]:
    """bubblewrap's arguments for the jail's root: read-only binds and private tmpfs."""
    args: list[str] = []
    for d in SYSTEM:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC:
        p = Path("/etc") / name
        if p.exists():
            args += ["--ro-bind", str(p), str(p)]
    args += ["--ro-bind", "/sys", "/sys"]  # hwloc and UCX read the machine's topology
    # The private /tmp first, the course's binds after: a course (and its venv) that lives
    # under /tmp, as a CI checkout may, is then mounted over the empty tmpfs, not hidden.
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(TMP_SIZE), "--tmpfs", "/tmp",
             "--perms", "01777", "--size", str(SHM_SIZE), "--tmpfs", "/dev/shm"]
    readable = {p.resolve() for p in [*_pythons(), _package(), *map(Path, extra)]}
    outer = sorted(p for p in readable if p.exists()
                   and not any(q != p and p.is_relative_to(q) for q in readable))
    args += parents(outer)
    for p in outer:
        args += ["--ro-bind", str(p), str(p)]
    return args


def parents(paths: Sequence[Path]) -> list[str]:
    """Folders on the way to ``paths``, made searchable (bubblewrap makes them 0700 as root)."""
    mounted = {Path("/"), Path("/tmp"), Path("/dev"), Path("/dev/shm")}  # the jail's own
    found = {a for p in paths for a in Path(p).parents if a not in mounted}
    return [arg for a in sorted(found, key=lambda a: len(a.parts))
            for arg in ("--perms", "0755", "--dir", str(a))]


def prefix(folder: Path, sockets: Path, filter_file: Path, extra: Sequence[Path] = (),
           groups: Sequence[Path] = (), relay: Path | None = None,
           env: dict[str, str] | None = None) -> list[str]:
    """The command that runs a job's ``mpiexec ...`` (appended to it) in the jail.

    ``folder`` is the job's own (the jail finds an empty, writable folder there),
    ``sockets`` the grader's socket's folder (with ``relay``, the folder of the learner
    processes' sockets: the only folders of the machine the jail may write),
    ``filter_file`` where the seccomp program is written (outside the jail's view),
    ``extra`` more read-only folders (``mpiexec``'s, where it is not in the venv),
    ``groups`` the cgroups every process of the jail belongs to (the first process joins
    them; its children are born in them), ``env`` its whole environment.
    """
    binds = [sockets] if relay is None else [sockets, relay]
    return _jailed(binds, filter_file, extra, groups, tmpfs=folder, env=env)


def _jailed(binds: Sequence[Path], filter_file: Path, extra: Sequence[Path] = (),
            groups: Sequence[Path] = (), tmpfs: Path | None = None,
            env: dict[str, str] | None = None) -> list[str]:
    """The command that runs a command (appended to it) in a jail of its own: ``binds`` the
    only folders it may write, ``tmpfs`` an empty one of its own, ``env`` its environment
    (given: nothing else of the grader's; else the grader's own)."""
    program, wrap, prlimit = seccomp_program(), bwrap(), shutil.which("prlimit")
    setpriv = shutil.which("setpriv") if os.geteuid() == 0 else ""  # needed as root only
    if program is None or wrap is None or prlimit is None or setpriv is None:
        raise RuntimeError(available()[1])
    filter_file = Path(filter_file)
    if not filter_file.is_file() or filter_file.read_bytes() != program:
        # written whole, then renamed: a jail starting meanwhile reads the old file or this
        part = filter_file.with_name(filter_file.name + ".part")
        part.write_bytes(program)
        os.replace(part, filter_file)
    nproc = LIMITS["nproc"] + (0 if os.geteuid() == 0 else _my_threads())
    limits = [f"--{k}={nproc if k == 'nproc' else v}" for k, v in LIMITS.items()]
    own = [] if tmpfs is None else ["--perms", "01777", "--size", str(1 << 20), "--tmpfs",
                                    str(tmpfs)]
    jail = [wrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            *view(extra), *parents([*([] if tmpfs is None else [tmpfs]), *binds]), *own,
            *[a for b in binds for a in ("--bind", str(b), str(b))], "--chdir", "/tmp",
            *(["--clearenv"] if env is not None else []),
            *[a for k, v in (env or {}).items() for a in ("--setenv", k, v)],
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--seccomp", "9"]
    if os.geteuid() == 0:  # become nobody (setpriv), then nothing can be regained
        jail += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                 "--", setpriv, f"--reuid={UID}", f"--regid={UID}",
                 "--clear-groups", "--inh-caps=-all"]
    else:  # a user namespace of bubblewrap's: nobody inside, this user outside
        jail += ["--unshare-user", "--uid", str(UID), "--gid", str(UID), "--cap-drop", "ALL",
                 "--"]
    # fd 9: the filter, opened by the shell that joins the cgroups and execs prlimit,
    # which execs bubblewrap
    join = "".join(f'echo $$ >"{g}/cgroup.procs" || {{ echo "pcourse: cannot join the cgroup '
                   f'{g}" >&2; exit 125; }}; ' for g in groups)
    return ["sh", "-c", f'exec 9<"$0"; {join}exec "$@"', str(filter_file),
            prlimit, *limits, "--", *jail]


def _my_threads() -> int:
    """Threads this user runs now (RLIMIT_NPROC counts them all, outside the jail too)."""
    uid, count = os.getuid(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def start_workers(folder: Path, n: int, apart: bool = True,
                  env: dict[str, str] | None = None) -> list[Any]:
    """The learner processes of the job in ``folder``: one per rank, each in a jail of its
    own (:mod:`pcourse.tools.grading.relay`), in the job's cgroups, with environment ``env``.

    Learner process k may write only ``folder/relay/k``, where it listens for rank k: it
    shares no ``/tmp``, ``/dev/shm``, network, IPC or process with the ranks or another
    learner process. Not ``apart``, the n share one jail (a network, for an exercise whose
    ranks open sockets to each other: ``folder/relay/net-k``), still apart from the ranks.
    """
    relay = Path(folder) / "relay"
    groups = cgroups(folder, fresh=False)
    owns = [relay / (str(k) if apart else f"net-{k}") for k in range(n)]
    for own in owns:
        own.mkdir(mode=0o755, exist_ok=True)
        os.chmod(own, 0o777)
    workers = []
    for k, mine in enumerate([[o] for o in owns] if apart else [owns]):
        command = [*_jailed(mine, Path(folder) / "seccomp.bpf", groups=groups, env=env),
                   sys.executable, "-m", "pcourse.tools.grading.learner",
                   *(str(o / "sock") for o in mine)]
        workers.append(subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=_worker_log(folder, k)))
    return workers


def _worker_log(folder: Path, k: int) -> Any:
    """Where worker k's errors go: $PCOURSE_RELAY_LOG's folder, or nowhere."""
    where = os.environ.get("PCOURSE_RELAY_LOG")
    if not where:
        return subprocess.DEVNULL
    return open(Path(where) / f"{Path(folder).name}-{k}.log", "ab")  # noqa: SIM115 - the child's


def stop_workers(workers: Sequence[Any], timeout: float = 30.0) -> None:
    """Kill the learner processes (bubblewrap, and with it its PID namespace) and wait."""
    for w in workers:
        if w.poll() is None:
            w.kill()
    for w in workers:
        try:
            w.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if w.stderr is not None:
            w.stderr.close()


def worker_namespaces(workers: Sequence[Any], timeout: float = 10.0) -> set[int]:
    """The PID namespaces of the learner processes' jails (see :func:`namespaces`)."""
    import psutil

    found, deadline = set(), time.monotonic() + timeout
    for w in workers:
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(w.pid).children()
                if children:
                    found.add(os.stat(f"/proc/{children[0].pid}/ns/pid").st_ino)
                    break
            except (psutil.Error, OSError):
                break
            time.sleep(0.01)
    return found


# ---------------------------------------------------------------- cgroups: limits per jail

def _cgroup_parents() -> list[tuple[Path, dict[str, str]]]:
    """Where this process may make cgroups, and the limit files each offers: under its own
    cgroup in cgroup v1's memory and pids hierarchies, or in v2's where its cgroup already
    hands both controllers to its children. [] where there is neither."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path.lstrip("/")
    except (OSError, ValueError):
        return []
    found = []
    for c, name in CGROUP_FILES[1].items():
        parent = CGROUPS / c / own.get(c, "")
        if c in own and (parent / "cgroup.procs").exists() and os.access(parent, os.W_OK):
            found.append((parent, {c: name}))
    if found or "" not in own:
        return found
    parent = CGROUPS / own[""]
    try:
        delegated = (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return []
    if {"memory", "pids"} <= set(delegated) and os.access(parent, os.W_OK):
        return [(parent, CGROUP_FILES[2])]
    return []


def _cgroup_name(folder: Path) -> str:
    return f"pcourse-{Path(folder).name}"


def cgroups(folder: Path, fresh: bool = True) -> list[Path]:
    """The cgroups of the jails of ``folder``, limited to :data:`CGROUP_LIMITS`: made afresh
    (``fresh``), else those made before, or made now if there are none; [] where the machine
    has none this process may make (rlimits alone bound the jail then)."""
    made = []
    for parent, files in _cgroup_parents():
        group = parent / _cgroup_name(folder)
        if not fresh and group.is_dir():
            made.append(group)
            continue
        _remove(group)  # one left empty by a grader that died
        try:
            group.mkdir()
            for key, name in files.items():
                (group / name).write_text(str(CGROUP_LIMITS[key]))
        except OSError:
            _remove(group)
            continue
        made.append(group)
    return made


def release(folder: Path | None = None, owner: int | None = None, timeout: float = 30.0
            ) -> None:
    """Remove the cgroups of the jail of ``folder`` (None: of every jail process ``owner``,
    by default this one, made), killing what is left in them first (nothing, after
    :func:`end`). RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    # a job's folder is named for the process that started it (job.Job)
    name = _cgroup_name(folder or Path(f"pcourse-grade-{owner or os.getpid()}-*"))
    for parent, _ in _cgroup_parents():
        for group in parent.glob(name):
            while not _remove(group):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cgroup {group} still holds processes")
                try:
                    _kill(map(int, (group / "cgroup.procs").read_text().split()))
                except OSError:  # removed meanwhile
                    pass
                time.sleep(0.05)


def _kill(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def _remove(group: Path) -> bool:
    try:
        group.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- waiting for the jail to end

def end(spaces: set[int], folder: Path, timeout: float = 30.0) -> None:
    """End the jails of the job in ``folder``: kill every process left in ``spaces`` (their
    PID namespaces), wait until none is left, and remove its cgroups (:func:`release`).

    Killing bubblewrap kills the jail's first process, but bubblewrap's init waits for
    every process of its namespace, and one that detached (``setsid``) keeps the jail
    alive: so each is killed here, by its namespace, until none is left. RuntimeError
    after ``timeout``. The grader writes nothing before they are gone.
    """
    deadline = time.monotonic() + timeout
    while spaces and (left := _members(spaces)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(left)[:5]} of a jail outlived it")
        _kill(left)
        time.sleep(0.05)
    release(folder, timeout=max(1.0, deadline - time.monotonic()))


def _members(spaces: set[int]) -> list[int]:
    """The live processes of the PID namespaces ``spaces``: a zombie has ended (its parent,
    this process where it adopted orphans, reaps it here)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino not in spaces:
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if state[0] != "Z":
            found.append(int(pid))
        elif int(state[1]) == os.getpid():
            try:
                os.waitpid(int(pid), os.WNOHANG)
            except ChildProcessError:
                pass
    return found
