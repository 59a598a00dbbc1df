"""PNG plots of benchmark results (matplotlib; skipped with a warning when it is missing)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    return plt


def throughput_vs_concurrency(levels: Sequence[Mapping[str, Any]], path: pathlib.Path,
                              title: str) -> pathlib.Path | None:
    """Output tokens/s and median TPOT against concurrency; ``levels``: [{concurrency, summary}]."""
    plt = _pyplot()
    if plt is None or not levels:
        return None
    xs = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [lv["summary"]["output_throughput"] for lv in levels], "o-", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(xs, [lv["summary"]["tpot_ms"]["p50"] for lv in levels], "s--", color="tab:red",
             label="TPOT p50 (ms)")
    ax2.set_ylabel("TPOT p50 (ms)", color="tab:red")
    ax.set_title(title)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdf(series: Mapping[str, Mapping[str, Sequence[float]]], path: pathlib.Path,
                title: str) -> pathlib.Path | None:
    """One panel per metric (TTFT, TPOT, e2e): a CDF line per scenario. Values in ms."""
    plt = _pyplot()
    if plt is None or not series:
        return None
    import numpy as np

    metrics = ("ttft_ms", "tpot_ms", "e2e_ms")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, metric in zip(axes, metrics):
        for scenario, values in series.items():
            data = np.sort(np.asarray(values.get(metric, ()), dtype=float))
            if data.size:
                xs = np.concatenate([data[:1], data])  # the CDF starts at 0
                ys = np.arange(data.size + 1) / data.size
                ax.step(xs, ys, where="post", label=scenario)
        ax.set_xlabel(metric.replace("_ms", " (ms)"))
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bars(values: Mapping[str, float], path: pathlib.Path, title: str,
         ylabel: str) -> pathlib.Path | None:
    """A labelled bar chart (offline throughput per engine, roofline floor vs step)."""
    plt = _pyplot()
    if plt is None or not values:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.8))
    names = list(values)
    heights = [values[n] for n in names]
    ax.bar(names, heights, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)])
    for i, h in enumerate(heights):
        ax.annotate(f"{h:.1f}", (i, h), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
