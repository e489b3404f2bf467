"""``python -m pcourse.tools.bench MODE``: franke, mnist, steps, comm, versus-source,
mpich-allreduce, sharding, tp or pp.

One front door.

``franke`` and ``mnist`` go to :mod:`pcourse.tools.bench.scaling`; ``steps`` and ``comm``
to :mod:`pcourse.tools.bench.steps` and :mod:`pcourse.tools.bench.commbench`; ``versus-source``
times the scaling command beside the source's own script
(:mod:`pcourse.tools.bench.versus`); ``mpich-allreduce`` forces each of MPICH's allreduce
algorithms in turn (:mod:`pcourse.tools.bench.mpich`); ``sharding`` sets ZeRO and FSDP beside
torch's own (:mod:`pcourse.tools.bench.sharding`); ``tp`` tensor parallelism beside torch's
DTensor (:mod:`pcourse.tools.bench.tp`); ``pp`` the pipeline's bubble and memory beside
the prediction, and beside torch's pipelining (:mod:`pcourse.tools.bench.pp`). Nothing
heavy is imported here: the benchmark's launcher starts its ranks before anything loads
torch.
"""

import sys

COMMANDS = {"steps": "pcourse.tools.bench.steps", "comm": "pcourse.tools.bench.commbench",
            "versus-source": "pcourse.tools.bench.versus",
            "mpich-allreduce": "pcourse.tools.bench.mpich",
            "sharding": "pcourse.tools.bench.sharding", "tp": "pcourse.tools.bench.tp",
            "pp": "pcourse.tools.bench.pp"}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0
    from pcourse.tools.bench.scaling import main as run

    return run(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
