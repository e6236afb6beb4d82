"""The sweep's figures, from fit.json's data: loss against N with each group's law and its bootstrap
band, the DiLoCo-minus-sync gap against N, and each hyper-parameter's optimum against N. Pure
functions to a matplotlib Figure, on the Agg backend (no display where sweeps run)."""

from __future__ import annotations

import matplotlib
import numpy as np

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402

from pipeline.scaling.laws import predict  # noqa: E402


def loss_against_size(fit: dict) -> Figure:
    """Best bits per byte at each N per group (points), its law (line) and 95% band (shaded)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for color, (name, group) in zip(_colors(len(fit["groups"])), fit["groups"].items()):
        n = np.array([s["N"] for s in group["sizes"]], float)
        ax.plot(n, [s["bits_per_byte"] for s in group["sizes"]], "o", color=color, label=name)
        law = group["law"]
        if not law.get("fitted"):
            continue
        xs = np.geomspace(n.min() / 1.5, n.max() * 1.5, 60)
        ax.plot(xs, [predict(law, x) for x in xs], "-", color=color, linewidth=1)
        params = law["bootstrap"]["params"]
        if params:
            curves = np.array([[a * x**-alpha + e for x in xs] for a, alpha, e in params])
            ax.fill_between(xs, *np.percentile(curves, [2.5, 97.5], axis=0), color=color, alpha=0.15, linewidth=0)
    seen = [s["bits_per_byte"] for g in fit["groups"].values() for s in g["sizes"]]
    if seen:  # the points decide the view: a wide bootstrap band beyond them would flatten them
        ax.set_ylim(min(seen) - 0.15 * (max(seen) - min(seen) + 0.1), max(seen) + 0.25 * (max(seen) - min(seen) + 0.1))
    ax.set_xscale("log")
    ax.set(
        xlabel="non-embedding parameters per path (N)",
        ylabel="held-out bits per byte",
        title="Loss against size: L(N) = A N^-alpha + E per algorithm and M",
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def gap_against_size(fit: dict) -> Figure:
    """DiLoCo minus sync (bits per byte) at each N, one line per M; 0 is parity."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m, entry in fit["gap"].items():
        rows = entry["by_size"]
        ax.plot([r["N"] for r in rows], [r["gap"] for r in rows], "o-", label=m)
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.set_xscale("log")
    ax.set(
        xlabel="non-embedding parameters per path (N)",
        ylabel="DiLoCo - sync (bits per byte)",
        title="DiLoCo-minus-sync gap against size",
    )
    if fit["gap"]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no size with both algorithms at one M", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def optima_against_size(fit: dict) -> Figure:
    """One panel per hyper-parameter: each group's optimum at each N, and its power law."""
    names = sorted({k for g in fit["groups"].values() for k in g["optima"]})
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.2 * max(1, len(names)), 3.8), squeeze=False)
    if not names:
        axes[0][0].text(0.5, 0.5, "no hyper-parameter axis", ha="center", va="center")
    for ax, name in zip(axes[0], names):
        for color, (group, entry) in zip(_colors(len(fit["groups"])), fit["groups"].items()):
            optimum = entry["optima"].get(name)
            if not optimum or not optimum["by_size"]:
                continue
            rows = [s for s in optimum["by_size"] if isinstance(s["value"], (int, float))]
            ax.plot([s["N"] for s in rows], [s["value"] for s in rows], "o", color=color, label=group)
            trend = optimum["trend"]
            if trend.get("fitted") and rows:
                xs = np.geomspace(min(s["N"] for s in rows), max(s["N"] for s in rows), 20)
                ys = trend["c"] * xs ** trend["b"] if trend["trend"] else np.full_like(xs, trend["constant"])
                ax.plot(xs, ys, "-", color=color, linewidth=1)
        ax.set_xscale("log")
        ax.set(xlabel="N", ylabel=f"best {name}", title=f"Optimal {name}")
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    return fig


FIGURES = {
    "loss_vs_params.png": loss_against_size,
    "gap_vs_params.png": gap_against_size,
    "optima_vs_params.png": optima_against_size,
}


def _colors(n: int) -> list:
    return [plt.get_cmap("tab10")(i % 10) for i in range(max(n, 1))]
