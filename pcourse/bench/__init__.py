"""Benchmarks: every speed claim of the course, measured and printed side by side.

``comm`` (allreduce latency and bandwidth, with ``commreport`` to read the rows),
``scaling`` (training time per backend and rank count), ``steps`` (per-step time
of each gradient-averaging strategy, against DDP), ``versus`` (the scaling command
beside the source's own script). Each measures with one function that runs on
every rank of an MPI communicator, reached through two front doors (``jobs``):
``run_on(mc.view, ...)`` on a lesson's running engines, and
``python -m pcourse.bench franke|mnist|steps|comm ...`` in an MPI job of its own.
"""
