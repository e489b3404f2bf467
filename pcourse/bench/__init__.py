"""Benchmarks: every speed claim of the course, measured and printed side by side.

``comm`` (allreduce latency and bandwidth, with ``commreport`` to read the rows),
``scaling`` (training time per backend and rank count), ``steps`` (per-step time
against DDP). ``python -m pcourse.bench franke|mnist|steps|comm ...`` reaches all four.
"""
