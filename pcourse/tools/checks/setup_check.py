"""What works on this machine: the one cell an instructor asks everyone to run.

It answers the questions a workshop loses its first half hour to: which versions
are installed, does MPI start engines, which of the four allreduce backends can
run here (and if not, why not), and does an allreduce across two engines give the
right answer. It ends with one READY line, or with one NOT READY line per problem,
each naming one of the :data:`REASONS` below and its fix. They are all the reasons it
can give: ``python -m pcourse.tools.workshop.timings --render`` turns them into the
instructors' troubleshooting table.

Also a command: ``python -m pcourse.tools.checks.setup_check [-n ENGINES]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import sys
from dataclasses import dataclass

import ipyparallel as ipp

from pcourse.backends import backend_status, unavailable_reason
from pcourse.tools.cluster import MPICluster, start_cluster, stop_cluster
from pcourse.tools.cluster.launch import MPINotFound, find_mpiexec

SMOKE_TIMEOUT = 120.0  # seconds for one backend's allreduce on every engine
NEEDED = ("mpi", "gloo")  # what every lesson needs; the NCCL backends are a bonus
UNUSABLE = {"mpi": "mpi-unusable", "gloo": "gloo-unusable"}  # NEEDED -> reason code

# A smoke-test verdict starts with one of these words.
OK, WRONG, FAILED, HUNG, NOT_TESTED = "OK", "WRONG", "FAILED", "HUNG", "NOT TESTED"


@dataclass(frozen=True)
class Reason:
    """One way the check can end NOT READY: what it prints, and what to do about it."""

    code: str
    says: str  # a format string; its fields are filled in where the reason is given
    fix: str


REASONS = {r.code: r for r in (
    Reason("no-mpiexec", "no mpiexec to start the engines with",
           "`make setup` installs the `mpich` wheel, which puts `mpiexec` in `.venv/bin`; "
           "start JupyterLab with `make lab`, which puts it first on PATH. Outside the "
           "venv: `pip install mpich`, or load your cluster's MPI module."),
    Reason("cluster-failed", "{n} engines did not start: {error}",
           "The error and the engines' log above say why. Check MPI alone: "
           "`.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py.bench helloworld`. "
           "Then restart the kernel (it stops engines left from an earlier run) and "
           "run the check again."),
    Reason("mpi-unusable", "the mpi backend cannot run here: {why}",
           "mpi4py is missing from the kernel's environment: run `make setup` and start "
           "JupyterLab with `make lab` (the kernel must be the course's `.venv`); conda: "
           "`conda install -c conda-forge mpi4py mpich`."),
    Reason("gloo-unusable", "the gloo backend cannot run here: {why}",
           "This torch build has no torch.distributed with Gloo. Install the course's "
           "torch (`make setup` installs torch==2.13.0 from PyPI; conda: `pytorch` from "
           "conda-forge)."),
    Reason("allreduce-failed", "the allreduce over {backend} raised {error}",
           "The error names the cause. For gloo it is most often a network interface "
           "the engines cannot use (VPN, firewall): start JupyterLab with "
           "`GLOO_SOCKET_IFNAME=lo make lab` and run the check again."),
    Reason("allreduce-wrong", "the allreduce over {backend} gave a wrong sum: {detail}",
           "Two MPI libraries are mixed: mpi4py built for one, the engines started by "
           "another's `mpiexec`. Use only the course's venv (`make lab`); if it persists, "
           "`make clean-venv setup`."),
    Reason("allreduce-hung", "the allreduce over {backend} gave no answer within {seconds} s",
           "The engines cannot reach each other, or the machine is overloaded. Close "
           "other heavy programs; for gloo, start JupyterLab with "
           "`GLOO_SOCKET_IFNAME=lo make lab`. Restart the kernel and run the check again."),
    Reason("no-mnist", "MNIST's test split, which lessons 06 and 07 train on, cannot be "
           "read: {error}",
           "With a network, run the check again: it downloads the four files into "
           "~/.cache/pcourse/mnist. Offline, copy `t10k-images-idx3-ubyte.gz` and "
           "`t10k-labels-idx1-ubyte.gz` into a folder and start JupyterLab with "
           "`PCOURSE_MNIST_DIR=that/folder make lab` (`make lab` already points it at "
           "`../shared/data/mnist` where that exists)."),
    Reason("not-tested", "the {backend} backend was not tested: the engines were stuck in "
           "an earlier backend",
           "Fix the backend that hung first (see allreduce-hung), restart the kernel, and "
           "run the check again."),
)}


def not_ready(code: str, **fields: object) -> None:
    """Print one NOT READY line for ``REASONS[code]``, and its fix."""
    reason = REASONS[code]
    print(f"NOT READY [{code}]: {reason.says.format(**fields)}")
    print(f"  fix: {reason.fix}")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Versions of everything the course runs on, as name -> text."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi4py": _version("mpi4py"),
    }
    try:
        from mpi4py import MPI

        out["MPI library"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - report, don't crash the check
        out["MPI library"] = f"unusable: {exc}"
    if torch.version.cuda:
        out["torch"] += f" (CUDA {torch.version.cuda})"
    out["ipyparallel"] = _version("ipyparallel")
    out["cupy"] = cupy_version()
    from pcourse.runtime.ranks import gpu_count  # looked up now: the tests fake it

    out["GPUs"] = str(gpu_count())
    return out


def cupy_version() -> str:
    """The installed CuPy, whichever wheel brought it: ``cupy`` (conda, a source build)
    or a prebuilt ``cupy-cudaNNx`` (``cupy-cuda12x``, ``cupy-cuda13x``, ...)."""
    found = sorted({(dist.metadata["Name"] or "").lower(): dist.version
                    for dist in importlib.metadata.distributions()
                    if re.fullmatch(r"cupy(-cuda\d+x)?", (dist.metadata["Name"] or "").lower())
                    }.items())
    if not found:
        return "not installed"
    return ", ".join(version if name == "cupy" else f"{version} ({name})"
                     for name, version in found)


def print_versions() -> None:
    for name, value in versions().items():
        print(f"{name:<12} {value}")


def print_backends(n: int | None = None) -> list[str]:
    """Print the backend table; return the names usable here (with ``n`` engines, if given:
    a GPU backend with fewer GPUs than engines is not, and the table says why)."""
    print(f"{'backend':<11} {'usable':<7} reason")
    usable = []
    for row in backend_status(n):
        print(f"{row.name:<11} {'yes' if row.usable else 'no':<7} {row.reason}")
        if row.usable:
            usable.append(row.name)
    return usable


def _engine_smoke(name: str) -> list[float]:
    """On an engine: allreduce rank+1 over backend ``name``; return the result."""
    import torch

    from pcourse.backends import make_backend

    with make_backend(name) as backend:
        t = torch.full((5,), float(backend.rank + 1), device=backend.device)
        backend.allreduce(t, "sum")
        return t.cpu().tolist()


def smoke_test(mc: MPICluster, names: list[str]) -> dict[str, str]:
    """Allreduce over every backend in ``names`` on the cluster, checked in closed form.

    Every rank contributes rank+1, so every rank must hold n(n+1)/2 afterwards.
    """
    expected = mc.n * (mc.n + 1) / 2
    verdicts: dict[str, str] = {}
    for name in names:
        try:
            results = mc.view.apply_async(_engine_smoke, name).get(timeout=SMOKE_TIMEOUT)
            ok = all(v == expected for r in results for v in r)
            verdicts[name] = OK if ok else f"{WRONG}: got {results}, expected {expected}"
        except ipp.error.TimeoutError:
            # The engines are still stuck inside that backend: nothing more can run.
            verdicts[name] = f"{HUNG}: no answer within {SMOKE_TIMEOUT:.0f} s"
            for rest in names[names.index(name) + 1:]:
                verdicts[rest] = f"{NOT_TESTED}: the engines were stuck in the previous backend"
            break
        except Exception as exc:  # noqa: BLE001 - a failing backend is a verdict, not a crash
            verdicts[name] = f"{FAILED}: {type(exc).__name__}: {exc}"
    return verdicts


def run(n: int = 2) -> bool:
    """The whole check; prints as it goes and returns True when the machine is ready."""
    print_versions()
    print()
    usable = print_backends(n)
    print()
    try:
        find_mpiexec()
    except MPINotFound:
        not_ready("no-mpiexec")
        return False
    try:
        mc = start_cluster(n)
    except Exception as exc:  # noqa: BLE001 - the check reports every failure
        not_ready("cluster-failed", n=n, error=exc)
        return False
    try:
        print(mc.table())
        print()
        verdicts = smoke_test(mc, usable)
    finally:
        stop_cluster(mc)
    for name, verdict in verdicts.items():
        print(f"allreduce over {name:<11} {verdict}")
    mnist = mnist_problem()
    print(f"MNIST's test split (lessons 06, 07): {OK if mnist is None else 'cannot be read'}")
    return print_verdict(verdicts, mnist)


def mnist_problem() -> str | None:
    """Why MNIST's test split cannot be read here (None: it can).

    Read as lesson 06 reads it ($PCOURSE_MNIST_DIR, the cache, a download where
    allowed), so READY means lesson 06 will find it too. The folder is not printed:
    a stored output must not hold this machine's paths.
    """
    from pcourse.workloads.mnist import read_mnist

    try:
        read_mnist("test")
    except Exception as exc:  # noqa: BLE001 - any failure means lesson 06 stops too
        return f"{type(exc).__name__}: {exc}"
    return None


def print_verdict(verdicts: dict[str, str], mnist: str | None = None) -> bool:
    """READY when the MPI and Gloo backends pass the smoke test and MNIST can be read,
    else why not.

    Those are what every lesson needs; the NCCL backends are a bonus that the
    table above reports. The line is the same on every ready machine, so nbval can
    check it. ``verdicts`` are :func:`smoke_test`'s; a needed backend missing from them
    was not usable here. ``mnist``: :func:`mnist_problem`'s answer.
    """
    problems = [b for b in NEEDED if verdicts.get(b) != OK]
    for backend in problems:
        verdict = verdicts.get(backend)
        word, _, detail = (verdict or "").partition(": ")
        if verdict is None:
            not_ready(UNUSABLE[backend], why=unavailable_reason(backend) or "not tested")
        elif word == WRONG:
            not_ready("allreduce-wrong", backend=backend, detail=detail)
        elif word == HUNG:
            not_ready("allreduce-hung", backend=backend, seconds=f"{SMOKE_TIMEOUT:.0f}")
        elif word == NOT_TESTED:
            not_ready("not-tested", backend=backend)
        else:
            not_ready("allreduce-failed", backend=backend, error=detail or verdict)
    if mnist is not None:
        not_ready("no-mnist", error=mnist)
    if problems or mnist is not None:
        return False
    print("READY")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--engines", type=int, default=2, help="engines to start")
    args = parser.parse_args(argv)
    return 0 if run(args.engines) else 1


if __name__ == "__main__":
    sys.exit(main())
