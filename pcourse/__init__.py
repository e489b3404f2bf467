"""pcourse: data-parallel training from scratch.

The package is what the notebooks build up and import; each module holds one idea.

Running ranks
    ``cluster``      start an MPI cluster of ipyparallel engines from a notebook
    ``rankinfo``     who am I in the MPI job, and which device do I own
    ``launch``       run a script under mpiexec with a deadline
    ``setup_check``  what works on this machine, in one table (lesson 00)
Data and gradients
    ``partition``    one seeded shuffle, equal shards (lesson 02)
    ``training``     average gradients, broadcast weights, check consistency (01, 05)
    ``buckets``      flattened, overlapped gradient allreduce, as DDP does (07)
    ``averaging``, ``syncbn``, ``hogwild``   beyond exact SGD (08)
Communication
    ``backends``     one allreduce interface; ``mpi_backend``, ``torch_backend``
                     (Gloo, NCCL) and ``cupy_backend`` (NCCL) behind it (04)
    ``collectives``  tree, ring and recursive-doubling allreduce from scratch (03)
    ``netns``, ``multinode``   several nodes, and two of them on one machine (09)
Workloads and measurements
    ``franke``, ``mnist``, ``vae``, ``train``   the source's two workloads, one loop (05, 06)
    ``commbench`` / ``commreport``, ``bench``, ``stepbench``, ``gpu_check``   benchmarks
Exercises
    ``exercises`` (generate exercises/ from solutions/), ``grade``

Importing ``pcourse`` is cheap and never touches MPI or CUDA.
"""

__version__ = "0.1.0"
