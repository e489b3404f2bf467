"""Reading an allreduce benchmark: rates, tables, the alpha-beta fit, the plot.

:mod:`pcourse.tools.bench.commbench` measures; this module turns its rows (or the CSV it wrote,
via :func:`read_rows`) into what a learner compares: latency, algorithm and bus
bandwidth side by side with the speed relative to MPI's native ``Allreduce``, and
a log-log plot where the fitted alpha-beta model shows where latency ends and
bandwidth begins.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np

from pcourse import collectives
from pcourse.utils.io import savefig_atomic

MiB = 1 << 20
HEADLINE_BYTES = 4 * MiB
FIELDS = ["ranks", "method", "bytes", "iterations", "latency_us", "algbw_GBps",
          "busbw_GBps", "speed_vs_mpi", "median_us", "p25_us", "p75_us", "mean_us"]
Fits = dict[tuple[int, str], tuple[float, float]]


def read_rows(path: str | os.PathLike[str]) -> list[dict]:
    """The rows of a commbench CSV, with numbers as numbers."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("ranks", "bytes", "iterations"):
            r[key] = int(r[key])
        for key in FIELDS[4:]:
            r[key] = float(r[key])
    return rows


def add_rates(rows: list[dict]) -> list[dict]:
    """Latency, algbw, busbw (nccl-tests definition) and speed relative to MPI native.

    busbw = algbw · 2(p-1)/p is what each link must carry for the ring, the
    bandwidth-optimal algorithm, so it can be compared with a link's speed and
    across rank counts. Rows need ranks, method, bytes and seconds (the benchmark
    puts the median call there, so every rate is the median's).
    """
    for r in rows:
        r["latency_us"] = r["seconds"] * 1e6
    native = {(r["ranks"], r["bytes"]): r["latency_us"] for r in rows if r["method"] == "mpi"}
    for r in rows:
        p, t = r["ranks"], r["seconds"]
        r["algbw_GBps"] = r["bytes"] / t / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * collectives.cost_terms("ring", p)[1]
        ref = native.get((p, r["bytes"]))
        r["speed_vs_mpi"] = ref / r["latency_us"] if ref else float("nan")
    return rows


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _line(label: str, cells: list[str], widths: list[int]) -> str:
    return f"{label:>9}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))


def print_tables(rows: list[dict]) -> None:
    """Per rank count: latency, its spread, busbw and speed vs MPI native, a column
    per method."""
    for p in sorted({r["ranks"] for r in rows}):
        mine = [{**r, "spread_pct": _spread(r)} for r in rows if r["ranks"] == p]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        cell = {(r["bytes"], r["method"]): r for r in mine}
        widths = [max(10, len(m) + 2) for m in methods]
        for title, key, fmt in [("latency [us], median call", "latency_us", "{:.1f}"),
                                ("spread [%]: (p75 - p25) / median", "spread_pct", "{:.0f}"),
                                ("busbw [GB/s]", "busbw_GBps", "{:.3f}"),
                                ("speed vs MPI native (t_mpi / t)", "speed_vs_mpi", "{:.2f}")]:
            print(f"\n{p} ranks, float32 in-place allreduce: {title}")
            print(_line("size", methods, widths))
            for nbytes in sorted({r["bytes"] for r in mine}):
                vals = [fmt.format(cell[nbytes, m][key]) if (nbytes, m) in cell else "-"
                        for m in methods]
                print(_line(human(nbytes), vals, widths))


def _spread(row: dict) -> float:
    if "p75_us" not in row:
        return float("nan")
    return 100 * (row["p75_us"] - row["p25_us"]) / row["latency_us"]


def fit_all(rows: list[dict]) -> Fits:
    """Fitted (a, b) of t = a + b·N for every (ranks, method)."""
    fits = {}
    for key in dict.fromkeys((r["ranks"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["ranks"], r["method"]) == key]
        if len({r["bytes"] for r in mine}) >= 2:
            fits[key] = collectives.fit_alpha_beta([r["bytes"] for r in mine],
                                                   [r["latency_us"] * 1e-6 for r in mine])
    return fits


def print_fits(fits: Fits) -> None:
    """alpha and beta per method; for the from-scratch ones also per link message."""
    print("\nalpha-beta fit, t = alpha + beta * bytes (link: divided by the algorithm's "
          "steps and volume)")
    print(f"{'ranks':>5} {'method':>20} {'alpha [us]':>11} {'beta [ns/B]':>12} "
          f"{'1/beta [GB/s]':>14} {'link alpha':>11} {'link 1/beta':>12}")
    for (p, method), (a, b) in fits.items():
        link = ""
        if method in collectives.ALGORITHMS:
            steps, volume = collectives.cost_terms(method, p)
            link = f"{a / steps * 1e6:>11.2f} {volume / b / 1e9 if b > 0 else float('inf'):>12.3f}"
        print(f"{p:>5} {method:>20} {a * 1e6:>11.2f} {b * 1e9:>12.4f} "
              f"{1 / b / 1e9 if b > 0 else float('inf'):>14.3f} {link}")


def headline(rows: list[dict]) -> None:
    """Two ratios lesson 04 reads, each beside what the model predicts for it.

    The ring sends 2(p-1)/p bytes per byte of data, the least any point-to-point
    allreduce can (Patarasuk and Yuan, 2009). Where MPI's own algorithm for large
    messages is bandwidth-optimal too (MPICH's Rabenseifner is; at p = 2 every
    algorithm but the tree is), the model predicts a speed ratio of about 1, and
    the ring's Python overhead per step pulls it below; only an MPI algorithm that
    moves more bytes predicts more than 1. A measured ratio above 1 is then something
    the model does not explain. The pickle path adds a serialisation and copies to
    every call, so the model predicts a time ratio above 1; by how much is what the
    run shows.
    """
    print("\nheadline ratios")
    for p in sorted({r["ranks"] for r in rows}):
        by = {(r["method"], r["bytes"]): r for r in rows if r["ranks"] == p}
        ring = [(n, r["speed_vs_mpi"]) for (m, n), r in sorted(by.items())
                if m == "ring" and n >= HEADLINE_BYTES]
        if ring:
            volume = collectives.cost_terms("ring", p)[1]
            listed = ", ".join(f"{human(n)} {v:.2f}" for n, v in ring)
            print(f"  {p} ranks: ring speed / MPI native speed (>= {human(HEADLINE_BYTES)}): "
                  f"{listed}\n{'':11}model: about 1 where MPI's algorithm is bandwidth-optimal "
                  f"too, below 1 for the ring's Python overhead (the ring sends 2(p-1)/p = "
                  f"{volume:.2f} bytes per byte of data, the least a point-to-point "
                  "allreduce can)")
        pickle, buffer = by.get(("mpi-pickle", HEADLINE_BYTES)), by.get(("mpi", HEADLINE_BYTES))
        if pickle and buffer:
            print(f"  {p} ranks: pickle time / buffer time at {human(HEADLINE_BYTES)}: "
                  f"{pickle['latency_us'] / buffer['latency_us']:.1f}x\n{'':11}model: above 1 "
                  "(the pickle adds a serialisation and copies to every call)")
        if not ring and not (pickle and buffer):
            print(f"  {p} ranks: not measured (needs --max-bytes >= 4M with ring, mpi, "
                  "mpi-pickle)")


def plot(rows: list[dict], fits: Fits, path: str | os.PathLike[str] | None = None) -> Any:
    """Log-log latency vs size per rank count, measured points and fitted model lines."""
    from pcourse.utils.show import new_figure  # shows once in a notebook, leaks none

    ranks = sorted({r["ranks"] for r in rows})
    fig = new_figure(figsize=(6 * len(ranks), 4.5), layout="constrained")
    axes = fig.subplots(1, len(ranks), squeeze=False)[0]
    for ax, p in zip(axes, ranks, strict=True):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in rows if r["ranks"] == p)):
            mine = [r for r in rows if (r["ranks"], r["method"]) == (p, method)]
            n = np.array([r["bytes"] for r in mine], dtype=float)
            lat = np.array([r["latency_us"] for r in mine])
            spread = None
            if all("p25_us" in r for r in mine):  # the quartiles: how steady the calls were
                spread = [lat - [r["p25_us"] for r in mine], [r["p75_us"] for r in mine] - lat]
            ax.errorbar(n, lat, yerr=spread, fmt="o", ms=3, capsize=2, color=f"C{i}",
                        label=method)
            if (p, method) in fits:
                a, b = fits[p, method]
                model = (a + b * n) * 1e6
                ax.loglog(n[model > 0], model[model > 0], "-", lw=1, alpha=0.6, color=f"C{i}")
        measured = [r["latency_us"] for r in rows if r["ranks"] == p]
        ax.set_ylim(min(measured) / 2, max(measured) * 2)  # a zero-latency fit: no abyss
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(title=f"{p} ranks (points: median, bars: quartiles; lines: alpha-beta fit)",
               xlabel="message size [bytes]", ylabel="latency [us]")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    if path is not None:
        savefig_atomic(fig, path, dpi=120)
    return fig


def print_report(rows: list[dict]) -> Fits:
    """The tables, the alpha-beta fits and the headline ratios of rows with rates."""
    print_tables(rows)
    fits = fit_all(rows)
    print_fits(fits)
    headline(rows)
    return fits


def report(rows: list[dict], out: Path, plot_path: Path) -> None:
    """Everything the command line prints and writes, from rows with rates. The CSV
    is written first: a plot that fails loses no measurement."""
    from pcourse.utils.io import save, write_csv

    fits = print_report(rows)
    out = save(out, lambda path: write_csv(path, rows, FIELDS))
    try:
        plot_path = save(plot_path, lambda path: plot(rows, fits, path))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"\nwrote {out}; the plot failed: {exc}")
        return
    print(f"\nwrote {out} and {plot_path}")
