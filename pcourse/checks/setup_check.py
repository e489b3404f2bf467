"""What works on this machine: the one cell an instructor asks everyone to run.

It answers the questions a workshop loses its first half hour to: which versions
are installed, does MPI start engines, which of the four allreduce backends can
run here (and if not, why not), and does an allreduce across two engines give the
right answer. It ends with one READY / NOT READY line.

Also a command: ``python -m pcourse.checks.setup_check [-n ENGINES]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

import ipyparallel as ipp

from pcourse.backends import backend_status
from pcourse.cluster import MPICluster, start_cluster, stop_cluster

SMOKE_TIMEOUT = 120.0  # seconds for one backend's allreduce on every engine


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
    cupy = _version("cupy-cuda12x")
    out["cupy"] = cupy if cupy != "not installed" else _version("cupy")
    out["GPUs"] = str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return out


def print_versions() -> None:
    for name, value in versions().items():
        print(f"{name:<12} {value}")


def print_backends() -> list[str]:
    """Print the backend table; return the names usable here."""
    print(f"{'backend':<11} {'usable':<7} reason")
    usable = []
    for row in backend_status():
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
            verdicts[name] = "OK" if ok else f"WRONG: got {results}, expected {expected}"
        except ipp.error.TimeoutError:
            # The engines are still stuck inside that backend: nothing more can run.
            verdicts[name] = f"FAILED: no answer within {SMOKE_TIMEOUT:.0f} s (hung)"
            for rest in names[names.index(name) + 1:]:
                verdicts[rest] = "NOT TESTED: the engines were stuck in the previous backend"
            break
        except Exception as exc:  # noqa: BLE001 - a failing backend is a verdict, not a crash
            verdicts[name] = f"FAILED: {type(exc).__name__}: {exc}"
    return verdicts


def run(n: int = 2) -> bool:
    """The whole check; prints as it goes and returns True when the machine is ready."""
    print_versions()
    print()
    usable = print_backends()
    print()
    try:
        mc = start_cluster(n)
    except Exception as exc:  # noqa: BLE001 - the check reports every failure
        print(f"cluster: FAILED to start {n} engines: {exc}")
        print("NOT READY")
        return False
    try:
        print(mc.table())
        print()
        verdicts = smoke_test(mc, usable)
    finally:
        stop_cluster(mc)
    for name, verdict in verdicts.items():
        print(f"allreduce over {name:<11} {verdict}")
    return print_verdict(verdicts)


def print_verdict(verdicts: dict[str, str]) -> bool:
    """READY when the MPI and Gloo backends pass the smoke test.

    Those two are what every lesson needs; the NCCL backends are a bonus that the
    table above reports. The line is the same on every ready machine, so nbval can
    check it.
    """
    missing = [b for b in ("mpi", "gloo") if verdicts.get(b) != "OK"]
    if missing:
        print(f"NOT READY: the {', '.join(missing)} backend failed; see the lines above.")
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
