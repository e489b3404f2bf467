"""Benchmarks: every speed claim of the course, measured and printed side by side.

``commbench`` (allreduce latency and bandwidth, with ``commreport`` to read the rows),
``scaling`` (training time per backend and rank count), ``steps`` (per-step time
of each gradient-averaging strategy, against DDP), ``versus`` (the scaling command
beside the source's own script), ``flops`` (how close a step runs to the machine's
compute limit), ``mpich`` (which allreduce MPICH runs), ``trace`` (one step with
buckets, as Perfetto reads it), ``sharding`` (ZeRO and FSDP beside torch's, the
strategies built by ``sharded``, their traced steps by ``overlap``), ``tp`` (tensor
parallelism beside torch's), ``pp`` (pipeline parallelism, the bubble measured), and
lesson 13's ``calibrate`` and ``predict`` (run as ``python -m pcourse.tools.bench.calibrate``
and ``.predict``; every strategy as one step in ``strategies``, measured by ``measured``,
torch's estimators in ``estimators``, the lesson's tables in ``report13``), lesson 14's
``restart`` (a run checkpointed, killed, resumed) and ``elastic`` (under torchrun). Each
measures with one function that runs on every rank of an MPI communicator, reached
through two front doors (``jobs``):
``run_on(mc.view, ...)`` on a lesson's running engines, and
``python -m pcourse.tools.bench franke|mnist|steps|comm ...`` in an MPI job of its own.

On a lesson's cluster (``mc = start_cluster(N)``), each call returns the rows
(dicts, the CSV's columns) and shows a progress bar; a rank count below N runs on
the first engines while the others wait::

    from pcourse.tools.bench import commbench, commreport, scaling, steps

    rows = commbench.run_on(mc.view, commbench.CommSpec() if FULL else commbench.CommSpec.quick())
    commreport.print_report(rows); commreport.plot(rows, commreport.fit_all(rows))

    rows = scaling.run_on(mc.view, "franke", CONFIG, backends=["mpi", "mpi-pickle", "gloo"],
                          ranks=[1, 2], repeats=2)
    table = scaling.aggregate(rows); scaling.print_table(table)
    scaling.plot(table, "Franke, strong scaling")

    rows = steps.run_on(mc.view, steps.StepSpec() if FULL else steps.StepSpec.quick())
    steps.print_table(rows)

Timings differ from run to run (tag those cells ``nbval-ignore-output``); the
losses in the scaling rows do not.
"""
