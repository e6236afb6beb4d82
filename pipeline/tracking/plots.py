"""The run's figures as PNG bytes: loss curves, documents per path, perplexity by round, and a
module-by-round heatmap of outer-gradient norms.

Pure functions from plain data to a matplotlib Figure, so the tracker can build them from
whatever it logged, in whichever process calls `finish`. The Agg backend is forced: the
orchestrating process (an Airflow worker, a CI job) has no display.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def loss_curves(losses: dict[str, dict[int, list[float]]], inner_steps: int | None = None) -> Figure:
    """One line per path over global inner steps (round * steps + step); rounds as grey lines.

    losses: {path_id: {round: [loss per inner step]}}.
    """
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = inner_steps or max((len(v) for rounds in losses.values() for v in rounds.values()), default=1)
    for pid in sorted(losses):
        xs, ys = [], []
        for rnd in sorted(losses[pid]):
            for step, value in enumerate(losses[pid][rnd]):
                xs.append(rnd * width + step)
                ys.append(value)
        ax.plot(xs, ys, label=pid, linewidth=1)
    last_round = max((r for rounds in losses.values() for r in rounds), default=0)
    for rnd in range(1, last_round + 1):
        ax.axvline(rnd * width, color="0.8", linewidth=0.8, zorder=0)  # an outer step happened here
    ax.set(xlabel="inner step (all rounds)", ylabel="training loss", title="Inner loss per path")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax, len(losses))
    fig.tight_layout()
    return fig


def docs_per_path(docs: dict[str, int]) -> Figure:
    """Bar chart of shard sizes: a starved path shows at a glance."""
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(docs) + 2), 4))
    ids = sorted(docs)
    ax.bar(ids, [docs[p] for p in ids], color="tab:blue")
    ax.set(xlabel="path", ylabel="documents", title="Documents routed to each path")
    ax.tick_params(axis="x", rotation=45 if len(ids) > 8 else 0)
    fig.tight_layout()
    return fig


def perplexity_by_round(
    overall: dict[int, float], per_path: dict[str, dict[int, float]], metric: str = "perplexity"
) -> Figure:
    """Routed perplexity (or bits per byte) after each merge; the overall curve is the one that matters."""
    label = {"perplexity": "perplexity", "bits_per_byte": "bits per byte"}.get(metric, metric)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pid in sorted(per_path):
        rounds = sorted(per_path[pid])
        ax.plot(rounds, [per_path[pid][r] for r in rounds], linewidth=0.8, alpha=0.6, label=pid)
    rounds = sorted(overall)
    ax.plot(rounds, [overall[r] for r in rounds], "k-o", linewidth=2, label="overall")
    ax.set(xlabel="round (modules at its start)", ylabel=label, title=f"Routed {label} by round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if metric == "perplexity" and overall and min(overall.values()) > 0:
        ax.set_yscale("log")
    _legend(ax, len(per_path) + 1)
    fig.tight_layout()
    return fig


def grad_norm_heatmap(norms: dict[str, dict[int, float]]) -> Figure:
    """Rows: modules, columns: rounds, colour: outer-gradient norm (blank: no path finished it)."""
    modules = sorted(norms)
    rounds = sorted({r for by_round in norms.values() for r in by_round})
    if not rounds:  # no path finished any round: nothing was merged, so say so instead of failing
        fig, ax = plt.subplots(figsize=(4.0, 3.0))
        ax.text(0.5, 0.5, "no module merged yet", ha="center", va="center")
        ax.set(title="Outer-gradient norm per module", xticks=[], yticks=[])
        return fig
    grid = [[norms[m].get(r, math.nan) for r in rounds] for m in modules]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rounds) + 3), max(3.0, 0.35 * len(modules) + 1.5)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds])
    ax.set_yticks(range(len(modules)), modules)
    ax.set(xlabel="round", title="Outer-gradient norm per module")
    fig.colorbar(image, ax=ax, label="||g_m||")
    fig.tight_layout()
    return fig


def close(fig: Figure) -> None:
    plt.close(fig)


def _legend(ax, entries: int) -> None:
    if 0 < entries <= 20:  # beyond that a legend hides the plot
        ax.legend(fontsize="small", ncol=2 if entries > 8 else 1)
