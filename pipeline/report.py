"""The one-screen summary every `dipaco run` ends with: perplexity and bits per byte by round and
path, the registered model version, one continuation written by the champion, and how to open
the MLflow UI on the result."""

from __future__ import annotations


def format_summary(summary: dict) -> str:
    evals = summary.get("eval", {})
    paths = sorted({p for result in evals.values() for p in result.get("paths", {})})
    header = ["round", "perplexity", "bits/byte", *paths]
    rows = [header]
    for round_index in sorted(evals, key=int):
        result = evals[round_index]
        cells = [str(round_index), _num(result.get("perplexity"), 2), _num(result.get("bits_per_byte"), 3)]
        cells += [_num(result.get("paths", {}).get(p, {}).get("bits_per_byte"), 3) for p in paths]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"dipaco run: {summary.get('run_root')}: {summary.get('rounds_committed')} round(s) committed",
             "held-out documents, tokens after the routing prefix, by modules at round start "
             "(overall perplexity and bits per byte; per path: bits per byte):"]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    if summary.get("model_version"):
        lines.append(f"registered model: models:/{summary['registered_model']}/{summary['model_version']} "
                     f"(alias champion: models:/{summary['registered_model']}@champion)")
    sample = summary.get("sample")
    if sample:
        lines.append(f"champion continues {sample['prompt']!r}: {sample['continuation']!r}")
    if summary.get("tracking_uri"):
        lines.append(f"MLflow UI: mlflow ui --backend-store-uri {summary['tracking_uri']} --port 5000")
    return "\n".join(lines)


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
