"""The one-screen summary every `dipaco run` ends with: perplexity by round and path, the
registered model version and how to open the MLflow UI on the result."""

from __future__ import annotations


def format_summary(summary: dict) -> str:
    evals = summary.get("eval", {})
    paths = sorted({p for result in evals.values() for p in result.get("paths", {})})
    header = ["round", "overall", *paths]
    rows = [header]
    for round_index in sorted(evals, key=int):
        result = evals[round_index]
        cells = [str(round_index), _ppl(result.get("perplexity"))]
        cells += [_ppl(result.get("paths", {}).get(p, {}).get("perplexity")) for p in paths]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"dipaco run: {summary.get('run_root')}: {summary.get('rounds_committed')} round(s) committed",
             "routed perplexity on held-out documents (tokens after the routing prefix), by modules at round start:"]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    if summary.get("model_version"):
        lines.append(f"registered model: models:/{summary['registered_model']}/{summary['model_version']} "
                     f"(alias champion: models:/{summary['registered_model']}@champion)")
    if summary.get("tracking_uri"):
        lines.append(f"MLflow UI: mlflow ui --backend-store-uri {summary['tracking_uri']} --port 5000")
    return "\n".join(lines)


def _ppl(value) -> str:
    return "-" if value is None else f"{value:.2f}"
