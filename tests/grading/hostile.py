"""Learner code that attacks the grader, as a hostile learner would (tests/test_grading.py).

Each is top-level code added to a learner cell: it runs in the learner's processes (one
per rank, behind the grader's ranks: pcourse.tools.grading.relay), inside the grader's
jail (pcourse.tools.grading.sandbox). An attack that reports back raises an
error whose one line (``HOSTILE key=value ...``) becomes the row's reason: the test
reads what the code could do there. Every piece passes the grader's static reading
of a learner cell (no ``open``, ``sys``, ``subprocess``...): it is the jail, not the
reading, that must stop it.
"""

from __future__ import annotations


def probe(readable: list[str]) -> str:
    """Who the code runs as, what it may do, and which of ``readable`` it can read."""
    return f"""
import os
_seen = []
for _p in {readable!r}:
    try:
        if os.path.isdir(_p):
            os.listdir(_p)
        else:
            os.close(os.open(_p, os.O_RDONLY))
        _seen.append(_p)
    except OSError:
        pass
_fd = os.open("/proc/self/status", os.O_RDONLY)
_status = os.read(_fd, 1 << 16).decode()
os.close(_fd)
_st = {{k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in _status.splitlines())}}
_fd = os.open("/proc/net/dev", os.O_RDONLY)
_ifaces = [ln.split(":")[0].strip() for ln in os.read(_fd, 1 << 16).decode().splitlines()[2:]]
os.close(_fd)
_others = 0  # processes of the job in sight: ranks, mpiexec, another learner process
for _pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        _fd = os.open(f"/proc/{{_pid}}/cmdline", os.O_RDONLY)
        _cmd = os.read(_fd, 1 << 12)
        os.close(_fd)
    except OSError:
        continue
    _others += any(w in _cmd for w in (b"grading.rank", b"mpiexec", b"hydra", b"gforker"))
_rc = {{w: os.waitstatus_to_exitcode(os.system(c + " >/dev/null 2>&1")) for w, c in [
    ("umount", "umount -l /tmp"), ("remount", "mount -o remount,rw /"),
    ("unshare", "unshare -Urm true"), ("kill1", "kill -9 1")]}}
raise RuntimeError("HOSTILE " + " ".join(f"{{k}}={{v}}" for k, v in [
    ("uid", os.getuid()), ("caps", _st.get("CapEff")), ("nnp", _st.get("NoNewPrivs")),
    ("seccomp", _st.get("Seccomp")), *_rc.items(), ("ifaces", ",".join(_ifaces)),
    ("others", _others), ("env", ",".join(k for k in os.environ if "PCOURSE" in k) or "-"),
    ("seen", ",".join(_seen) or "-")]))
"""


DAEMON_MARK = "pcourse-hostile-daemon"


def daemon(targets: list[str]) -> str:
    """Leave a process behind that keeps writing ``targets`` (the class's grades) for a minute,
    undoing what hides their folders first.

    It runs as ``sh -c LOOP pcourse-hostile-daemon``: a test finds it by that word.
    The learner's cell then goes on as if nothing happened.
    """
    folders = sorted({t.rsplit("/", 1)[0] for t in targets})
    loop = "; ".join([*(f"umount -l {f} 2>/dev/null" for f in folders),  # what hides them
                      *(f"echo pwned > {t} 2>/dev/null" for t in targets)])
    return f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c",
                             "for i in $(seq 600); do {loop}; sleep 0.1; done",
                             {DAEMON_MARK!r}])
    os._exit(0)
"""


PATCH = """
import os
_trials = os.sys.modules["pcourse.tools.grading.trials"]
_trials.pcourse_planted = "trials"
_builtins = os.sys.modules["builtins"]
_builtins.pcourse_planted = "builtins"
for _f in ["/tmp/pcourse_planted", "/dev/shm/pcourse_planted"]:
    os.close(os.open(_f, os.O_WRONLY | os.O_CREAT, 0o666))
"""  # what one learner leaves in its processes and jail, for the next learner to meet

FIND_PATCH = """
import os
_found = [getattr(os.sys.modules["pcourse.tools.grading.trials"], "pcourse_planted", None),
          getattr(os.sys.modules["builtins"], "pcourse_planted", None)]
_found += [f for f in ["/tmp/pcourse_planted", "/dev/shm/pcourse_planted"] if os.path.exists(f)]
raise RuntimeError("HOSTILE found=" + ",".join(str(f) for f in _found if f) + "|")
"""  # what the next learner reports: it must find nothing of the first

PATCH_MODULES = """
import os
_trials = os.sys.modules["pcourse.tools.grading.trials"]  # names of its own: past the reader
_trials.pcourse_planted = "trials"
_builtins = os.sys.modules["builtins"]
_builtins.pcourse_planted = "builtins"
"""  # what one exercise leaves in the learner's processes, for the same learner's next

FIND_PATCH_IN_MODULES = """
import os
_found = [getattr(os.sys.modules["pcourse.tools.grading.trials"], "pcourse_planted", None),
          getattr(os.sys.modules["builtins"], "pcourse_planted", None)]
raise RuntimeError("HOSTILE found=" + ",".join(str(f) for f in _found if f) + "|")
"""  # what the next exercise reports: it must find nothing of the one before


def report(text: str) -> dict[str, str]:
    """The ``key=value`` pairs of a HOSTILE line in a row's reason."""
    line = text[text.index("HOSTILE "):].split("\n")[0]
    return dict(part.split("=", 1) for part in line[len("HOSTILE "):].split(" ") if "=" in part)
