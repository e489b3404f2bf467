"""Lesson 13's figure and its table of misses, from ``predict.side_by_side`` rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def predicted_vs_measured(rows: Sequence[dict], machine: str = "") -> Any:
    """Two panels, step time and peak memory: each configuration a labelled point at
    (measured, predicted), the line y = x where a perfect prediction would lie."""
    import matplotlib.pyplot as plt

    from pcourse.utils.show import legend_beside

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    configs = [r for r in rows if r["rank"] == 0 and r["time"] is not None]
    panels = ((axes[0], configs, "time", "time_predicted", 1e3, "step time (ms)"),
              (axes[1], rows, "peak", "peak_predicted", 1e-6, "peak memory per rank (MB)"))
    for ax, points, got, said, scale, label in panels:
        for p, marker in ((2, "o"), (3, "s")):
            mine = [r for r in points if r["ranks"] == p]
            ax.scatter([r[got] * scale for r in mine], [r[said] * scale for r in mine],
                       marker=marker, label=f"{p} ranks")
            for r in mine:
                name = r["strategy"] + (f" r{r['rank']}" if got == "peak" and r["strategy"]
                                        in ("gpipe", "1f1b") else "")
                ax.annotate(name, (r[got] * scale, r[said] * scale), fontsize=6,
                            xytext=(3, 2), textcoords="offset points")
        values = [r[k] * scale for r in points for k in (got, said)]
        lo, hi = min(values) * 0.9, max(values) * 1.1
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="y = x")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        legend_beside(ax) if ax is axes[1] else ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("Predicted against measured" + (f" ({machine})" if machine else ""))
    fig.tight_layout()
    return fig


def misses(rows: Sequence[dict]) -> dict:
    """Print, per configuration, the step split into computation alone and the rest
    (messages, meetings, the bubble), predicted and measured; return the worst."""
    configs = [r for r in rows if r["rank"] == 0 and r["time"] is not None]
    print(f"{'strategy':14} {'p':>2} {'step error':>10}   {'compute ms pred':>15} "
          f"{'meas':>6}   {'rest ms pred':>12} {'meas':>6}")
    for r in configs:
        print(f"{r['strategy']:14} {r['ranks']:>2} {r['time_error']:>+10.0%}   "
              f"{r['compute_predicted'] * 1e3:>15.1f} {r['compute'] * 1e3:>6.1f}   "
              f"{(r['time_predicted'] - r['compute_predicted']) * 1e3:>12.1f} "
              f"{(r['time'] - r['compute']) * 1e3:>6.1f}")
    worst = max(configs, key=lambda r: abs(r["time_error"]))
    compute_miss = worst["compute_predicted"] - worst["compute"]
    rest_miss = (worst["time_predicted"] - worst["compute_predicted"]) - (
        worst["time"] - worst["compute"])
    part = "its computation" if abs(compute_miss) >= abs(rest_miss) else "the rest"
    larger = max(abs(compute_miss), abs(rest_miss)) * 1e3
    print(f"\nthe largest miss: {worst['strategy']} at {worst['ranks']} ranks, "
          f"{worst['time_error']:+.0%}; the larger part ({larger:.1f} ms, of "
          f"{abs(worst['time_predicted'] - worst['time']) * 1e3:.1f} ms in all) in {part}")
    return worst
