"""pcourse: parallel training from scratch.

The top level is what the lessons teach, one idea per module, in lesson order (the
lessons that teach each: the registry, ``course.toml``, lists the same; a test holds
the two together):

    ``data_parallel``  average gradients, broadcast weights, check consistency (01, 05)
    ``agree``          every rank checks the collective was called alike (01)
    ``partition``      one seeded shuffle, equal shards (02)
    ``collectives``    tree, ring and recursive-doubling allreduce, and the ring's two
                       halves (reduce-scatter, all-gather), from scratch (03, 10)
    ``timing``         the slowest rank's median call (04)
    ``backends/``      one allreduce interface (``base``) and the four real backends:
                       ``mpi`` (mpi4py), ``torch_dist`` (Gloo, NCCL), ``cupy_nccl``;
                       ``counting``, a wrapper that counts the bytes sent, and ``groups``,
                       a torch process group as a backend; point-to-point ``send`` and
                       ``recv`` (04, 10, 12)
    ``loop``           the training loop every lesson and benchmark runs (05)
    ``workloads/``     the source's two workloads: ``franke``, ``mnist`` + ``vae``; and
                       ``transformer``, a small causal transformer to split (05, 06, 11)
    ``buckets``        flattened, overlapped gradient allreduce, as DDP does (07)
    ``step_model``     a model of one overlapped step, and the bucket cap it picks (07)
    ``beyond_sgd/``    weight averaging, synchronised BatchNorm, Hogwild, compressed
                       gradients: ``weight_averaging``, ``syncbn``, ``hogwild``,
                       ``compression`` (08)
    ``multinode``      hostfiles and launchers for several nodes, the node-aware
                       allreduce (09)
    ``sharding/``      ZeRO-1 and ZeRO-2 (``zero``), FSDP (``fsdp``) on reduce-scatter
                       and all-gather, and what a rank holds (``memory``) (10)
    ``tensor_parallel`` column- and row-parallel layers, f and g, attention by heads,
                       sequence parallelism (11)
    ``mesh``           named dimensions of ranks and a group per dimension (11)
    ``activations``    what autograd saves for backward, counted (11)
    ``pipeline``       stages, micro-batches, the GPipe and 1F1B schedules (12)
    ``checkpointing``  activation checkpointing: recompute a block in the backward (13)
    ``cost_model/``    a step's memory and time predicted per rank, before it runs:
                       ``machine``, ``counting``, ``shapes``, ``memory``, ``step_time``,
                       ``compare``, ``scale`` (13)
    ``resume``         a checkpoint every rank writes, atomically, that resumes a run
                       exactly (14)
    ``reshard``        a checkpoint resumed at another number of ranks: ZeRO-1's
                       slices re-cut (14)
    ``notices``        a rank that fails tells the others why, so they can name it (14)
    ``checkpoint_interval`` how often to save: Young's interval, a run with failures (14)

Under both, the runtime layer (``runtime/``): ranks and devices (``ranks``), waits with
deadlines (``waits``), and the private names of torch, ipyparallel and ipykernel the
course relies on (``private``). No lesson shows it.

The workshop lives behind the lessons' modules, in one subpackage, ``tools/``: engines
and jobs (``cluster/``), benchmarks (``bench/``), the setup and GPU checks (``checks/``),
the grader (``grading/``), the instructor's kit (``workshop/``) and the website
(``book/``). ``utils/`` holds atomic results files, showing source in a notebook and
progress bars, for both.

Importing ``pcourse`` is cheap and never touches MPI or CUDA.
"""

__version__ = "0.1.0"
