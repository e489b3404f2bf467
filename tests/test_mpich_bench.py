"""mpich-allreduce: one comm job per forced algorithm, and MPICH's choice inferred from them."""

from __future__ import annotations

import math

from pcourse.tools.bench import mpich


def _rows(run: str, latencies: dict[int, float], ring: dict[int, float] | None = None):
    rows = [{"run": run, "method": "mpi", "bytes": str(b), "latency_us": str(t)}
            for b, t in latencies.items()]
    rows += [{"run": run, "method": "ring", "bytes": str(b), "latency_us": str(t)}
             for b, t in (ring or {}).items()]
    return rows


def test_the_choice_is_the_forced_algorithm_closest_to_auto_at_each_size() -> None:
    rows = (_rows("auto", {1024: 10.0, 4096: 50.0}, ring={1024: 20.0, 4096: 25.0})
            + _rows("recursive_doubling", {1024: 10.5, 4096: 90.0})
            + _rows("ring", {1024: 30.0, 4096: 49.0})
            + _rows("tree", {1024: 12.0, 4096: 70.0}))
    small, large = mpich.table(rows)
    assert (small["bytes"], small["closest"]) == (1024, "recursive_doubling")
    assert (large["bytes"], large["closest"]) == (4096, "ring")
    assert math.isclose(small["ring / auto"], 2.0) and math.isclose(large["ring / auto"], 0.5)


def test_every_run_forces_one_variable_and_auto_forces_none() -> None:
    assert mpich.RUNS["auto"] == {}
    for name in mpich.ALGORITHMS:
        assert mpich.RUNS[name] == {mpich.ALGORITHM_VAR: name}
    assert mpich.RUNS["auto, no shared memory"] == {"MPIR_CVAR_NOLOCAL": "1"}
