"""pcourse: data-parallel training from scratch.

The top level is what the lessons teach, one idea per module, in lesson order:

    ``data_parallel``  average gradients, broadcast weights, check consistency (01, 05)
    ``partition``      one seeded shuffle, equal shards (02)
    ``collectives``    tree, ring and recursive-doubling allreduce, and the ring's two
                       halves (reduce-scatter, all-gather), from scratch (03, 10)
    ``backends/``      one allreduce interface (``base``) and the four real backends:
                       ``mpi`` (mpi4py), ``torch_dist`` (Gloo, NCCL), ``cupy_nccl`` (04);
                       ``counting``, a wrapper that counts the bytes sent, and ``groups``,
                       a torch process group as a backend (10)
    ``loop``           the training loop every lesson and benchmark runs (05)
    ``workloads/``     the source's two workloads: ``franke``, ``mnist`` + ``vae`` (05, 06)
    ``buckets``        flattened, overlapped gradient allreduce, as DDP does (07)
    ``beyond_sgd/``    weight averaging, synchronised BatchNorm, Hogwild (08)
    ``multinode``      hostfiles and launchers for several nodes (09)
    ``sharding/``      ZeRO-1 and ZeRO-2 (``zero``), FSDP (``fsdp``) on reduce-scatter
                       and all-gather, and what a rank holds (``memory``) (10)

Under both, the runtime layer (``runtime/``): ranks and devices, waits with deadlines
and interrupts, the check that all ranks called a collective alike (``agree``), where
torch.distributed's ranks meet (``bootstrap``), and reaping the processes a run left.

Tooling lives behind the lessons' modules, in subpackages:

    ``cluster/``   engines for notebooks, ``mpiexec`` jobs, netns
    ``bench/``     the communication, scaling, per-step and sharding benchmarks
    ``checks/``    the setup check (lesson 00) and the GPU check
    ``grading/``   exercises generated from solutions, and the grader
    ``workshop/``  the instructor's kit: lesson timings, the generated tables of
                   INSTRUCTORS.md and the index, resetting a learner's notebook
    ``utils/``     atomic results files, showing source in a notebook, progress bars

Importing ``pcourse`` is cheap and never touches MPI or CUDA.
"""

__version__ = "0.1.0"
