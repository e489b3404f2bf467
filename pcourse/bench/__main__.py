"""``python -m pcourse.bench franke|mnist|steps|comm|versus-source|mpich-allreduce|sharding|pp``.

One front door.

``franke`` and ``mnist`` go to :mod:`pcourse.bench.scaling`; ``steps`` and ``comm``
to :mod:`pcourse.bench.steps` and :mod:`pcourse.bench.commbench`; ``versus-source``
times the scaling command beside the source's own script
(:mod:`pcourse.bench.versus`); ``mpich-allreduce`` forces each of MPICH's allreduce
algorithms in turn (:mod:`pcourse.bench.mpich`); ``sharding`` sets ZeRO and FSDP beside
torch's own (:mod:`pcourse.bench.sharding`); ``pp`` the pipeline's bubble and memory
beside the prediction, and beside torch's pipelining (:mod:`pcourse.bench.pp`).
Nothing heavy is imported here: the benchmark's launcher starts its ranks before
anything loads torch.
"""

import sys

COMMANDS = {"steps": "pcourse.bench.steps", "comm": "pcourse.bench.commbench",
            "versus-source": "pcourse.bench.versus", "mpich-allreduce": "pcourse.bench.mpich",
            "sharding": "pcourse.bench.sharding", "pp": "pcourse.bench.pp"}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0
    from pcourse.bench.scaling import main as run

    return run(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
