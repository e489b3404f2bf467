"""mpich-allreduce: one comm job per forced algorithm, and MPICH's choice inferred from them."""

from __future__ import annotations

import math

from pcourse.tools.bench import mpich


def _rows(run: str, latencies: dict[int, float], ring: dict[int, float] | None = None,
          spread: float = 0.05):
    def row(method: str, b: int, t: float) -> dict:
        return {"run": run, "method": method, "bytes": str(b), "latency_us": str(t),
                "median_us": str(t), "p25_us": str(t * (1 - spread)),
                "p75_us": str(t * (1 + spread))}

    return [row("mpi", b, t) for b, t in latencies.items()] + \
        [row("ring", b, t) for b, t in (ring or {}).items()]


def test_a_choice_matches_a_forced_algorithm_only_close_by() -> None:
    """Within 15% of the median and the quartiles overlapping, nearest first; beyond, none
    (auto at 4 MiB in the 2026-12-06 review: 340.8 µs, tree the nearest at 674.3, and
    called its match)."""
    rows = (_rows("auto", {1024: 10.0, 4096: 50.0, 4 << 20: 340.8}, ring={1024: 20.0, 4096: 25.0})
            + _rows("recursive_doubling", {1024: 10.5, 4096: 90.0, 4 << 20: 1610.3})
            + _rows("ring", {1024: 30.0, 4096: 49.0, 4 << 20: 1240.8})
            + _rows("tree", {1024: 10.9, 4096: 70.0, 4 << 20: 674.3})
            + _rows("auto, no device collectives", {1024: 10.0, 4096: 50.0, 4 << 20: 700.0}))
    small, large, huge = mpich.table(rows)
    assert small["matches auto"] == ["recursive_doubling", "tree"]
    assert large["matches auto"] == ["ring"]
    assert huge["matches auto"] == [] and huge["matches auto, no device collectives"] == ["tree"]
    assert math.isclose(small["ring / auto"], 2.0) and math.isclose(large["ring / auto"], 0.5)
    apart = mpich.table(_rows("auto", {1024: 10.0}, spread=0.01)
                        + _rows("tree", {1024: 11.0}, spread=0.01))  # 10% off, quartiles apart
    assert apart[0]["matches auto"] == []


def test_every_run_forces_one_variable_and_auto_forces_none() -> None:
    assert mpich.RUNS["auto"] == {}
    for name in mpich.ALGORITHMS:
        assert mpich.RUNS[name] == {mpich.ALGORITHM_VAR: name}
    assert mpich.RUNS["auto, no shared memory"] == {"MPIR_CVAR_NOLOCAL": "1"}
    assert mpich.RUNS["auto, no device collectives"] == {mpich.DEVICE_VAR: "0"}


def test_the_table_prints_a_column_for_every_run_made_and_none_for_a_run_left_out(capsys) -> None:
    """Quick mode leaves out the run with shared memory off: no column of NaNs for it; a
    run made keeps its column."""
    made = _rows("auto", {1024: 10.0}) + _rows("tree", {1024: 11.0})
    mpich.print_table(mpich.table(made))
    header = capsys.readouterr().out.splitlines()[1]
    assert "auto" in header and "tree" in header and "rec_doubling" not in header
    assert "no shm" not in header and "nan" not in header.lower()
    mpich.print_table(mpich.table(made + _rows("auto, no shared memory", {1024: 12.0})))
    assert "auto, no shm" in capsys.readouterr().out.splitlines()[1]
