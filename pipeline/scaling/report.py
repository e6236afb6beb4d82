"""The screen `dipaco sweep` ends with: the laws per algorithm and M, the best loss at each size, the
gap, the optimal hyper-parameters, the three findings, and the prediction (and holdout) if asked."""

from __future__ import annotations


def format_report(report: dict) -> str:
    fit = report["fit"]
    trained = (
        f", {report['trained']} trained now, {report['reused']} committed before"
        if report["trained"] is not None
        else f", {fit['sweep']['committed']} committed"
    )
    took = f"; {report['seconds'] / 60:.1f} min" if report["seconds"] is not None else ""
    lanes = report.get("lanes") or {}
    busy = (
        f"; {lanes['lanes']} lane(s) busy {lanes['utilisation']:.0%} of the time"
        if lanes.get("utilisation") is not None
        else ""
    )
    lines = [
        f"dipaco sweep: {report['sweep_root']}: {report['points']} point(s){trained}{took}{busy}",
        *(
            f"point {g['point']} given up after {g['attempts']} attempts ({g['error']}); to try it again: {g['retry']}"
            for g in report.get("given_up") or []
        ),
        "held-out bits per byte of the last round against N (non-embedding parameters of a path), best point "
        "at each size; L(N) = A * N^-alpha + E, 95% bootstrap intervals:",
    ]
    lines += _table(
        ["group", "sizes", "N", "bits/byte", "alpha", "E", "A", "rmse"],
        [_law_row(name, g) for name, g in fit["groups"].items()],
    )
    notes = sorted({g["law"]["note"] for g in fit["groups"].values() if g["law"].get("note")})
    lines += [f"  ({note})" for note in notes]
    for algorithm, joint in fit["joint"].items():
        if joint.get("fitted"):
            ci = joint["ci"]
            lines.append(
                f"joint law of {algorithm}, {joint['form']}: alpha {_ci(joint['alpha'], ci['alpha'])}, "
                f"beta {_ci(joint['beta'], ci['beta'])}, E {_ci(joint['E'], ci['E'])}, rmse {joint['rmse']:.4f}"
            )
        else:
            lines.append(f"joint law of {algorithm} across M: not fitted: {joint['why']}")
    sizes = sorted({s["N"] for g in fit["groups"].values() for s in g["sizes"]})
    best = {name: {s["N"]: s["bits_per_byte"] for s in g["sizes"]} for name, g in fit["groups"].items()}
    lines.append("best bits per byte by size:")
    lines += _table(["N", *best], [[_n(n), *(_num(best[g].get(n)) for g in best)] for n in sizes])
    for m, gap in fit["gap"].items():
        rows = ", ".join(f"{r['gap']:+.4f} at N={_n(r['N'])}" for r in gap["by_size"])
        slope = f" ({gap['slope_per_decade']:+.4f} per decade of N)" if "slope_per_decade" in gap else ""
        lines.append(f"DiLoCo minus sync, {m}: {rows}{slope}")
    optima = [(name, key, o) for name, g in fit["groups"].items() for key, o in g["optima"].items()]
    if optima:
        lines.append("optimal hyper-parameters (at each N; their law against N):")
    for name, key, o in optima:
        at = ", ".join(
            f"{_num(s['value'], 4)} at {_n(s['N'])}" + ("*" if s["method"] == "parabola" else "") for s in o["by_size"]
        )
        trend = o["trend"]
        law = (
            (f"{trend['c']:.3g} * N^{trend['b']:+.3f}" if trend.get("trend") else f"no trend: {trend['constant']:.3g}")
            if trend.get("fitted")
            else trend.get("why", "")
        )
        lines.append(f"  {name} {key}: {at}; {law}")
    if any(s["method"] == "parabola" for _, _, o in optima for s in o["by_size"]):
        lines.append("  (* vertex of a parabola through the loss against the log of the value)")
    lines.append(f"findings (tolerance {fit['tolerance']} bits per byte):")
    for finding in fit["findings"].values():
        lines.append(f"  {finding['verdict']:>14}: {finding['claim']}: {_evidence(finding)}")
    if "prediction" in fit:
        lines += _prediction(fit["prediction"])
    if "holdout" in fit:
        h = fit["holdout"]
        inside = "inside" if h["within_interval"] else "outside"
        lines.append(
            f"holdout {h['point']} ({h['group']}): predicted {h['predicted']:.4f}, measured {h['measured']:.4f}, "
            f"error {h['error']:+.4f} ({100 * h['relative_error']:+.1f}%), {inside} the interval "
            f"[{_num(h['interval'][0])}, {_num(h['interval'][1])}]"
        )
        if "H" in h:  # fit.json written before the holdout recorded its settings has none
            sources = ", ".join(f"{k} {_num(h['values'][k])}: {how}" for k, how in h["sources"].items())
            lines.append(
                f"  trained at N = {_n(h['N'])}, H {h['H']}, M {h['M']}, outer lr {_num(h['outer_lr'])}: "
                f"{h['rounds']} round(s), {h['steps']:,} steps, {h['tokens']:,} tokens per path ({sources})"
            )
    lines.append(f"fit: {report['fit_file']}; plots: {', '.join(fit['plots'])} and points.csv beside it")
    return "\n".join(lines)


def _law_row(name: str, group: dict) -> list[str]:
    sizes = group["sizes"]
    span = f"{_n(sizes[0]['N'])}..{_n(sizes[-1]['N'])}" if sizes else "-"
    loss = f"{sizes[0]['bits_per_byte']:.3f}..{sizes[-1]['bits_per_byte']:.3f}" if sizes else "-"
    law = group["law"]
    if not law.get("fitted"):
        return [name, str(len(sizes)), span, loss, f"not fitted: {law['why']}", "", "", ""]
    ci = law["ci"]
    e = "0 (fixed)" if law["form"] != "A * N^-alpha + E" else _ci(law["E"], ci["E"])
    return [
        name,
        str(len(sizes)),
        span,
        loss,
        _ci(law["alpha"], ci["alpha"]),
        e,
        f"{law['A']:.3g}",
        f"{law['rmse']:.4f}",
    ]


def _prediction(p: dict) -> list[str]:
    where = "inside" if p["inside_sweep"] else "outside"
    asked = ", ".join(f"{k}={v}" for k, v in p["values"].items())
    lines = [f"prediction at {asked} (N = {_n(p['N'])}, {where} the sweep's sizes):"]
    for name, g in p["groups"].items():
        loss = g["bits_per_byte"]
        text = (
            f"{loss['value']:.4f} bits/byte [{_num(loss['interval'][0])}, {_num(loss['interval'][1])}]"
            if loss
            else f"no law ({g['why']})"
        )
        hyper = "; ".join(f"{k} {_num(h['value'], 4)} ({h['how']})" for k, h in g["hyper"].items())
        lines.append(f"  {name}: {text}" + (f"; best {hyper}" if hyper else ""))
    return lines


def _evidence(finding: dict) -> str:
    if "why" in finding:
        return finding["why"]
    if "mean_change" in finding:
        per = ", ".join(f"{m} {c:+.4f}" for m, c in finding["change_by_M"].items())
        return f"gap changes by {finding['mean_change']:+.4f} from the smallest to the largest N ({per})"
    if "worst" in finding:
        rows = ", ".join(f"{d:+.4f} at {_n(n)}" for n, d in finding["difference_by_N"])
        return f"DiLoCo M=1 minus sync: {rows}"
    exponents = ", ".join(f"{g} {m['b']:+.3f}" for g, m in finding["exponent_by_group"].items())
    return f"the optimum moves {finding['moved_grid_steps']:.2f} grid steps over the sweep's N (exponents: {exponents})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]


def _ci(value: float, interval: list) -> str:
    low, high = interval
    return f"{_g(value)} [{_g(low)}, {_g(high)}]" if low is not None else _g(value)


def _g(value: float) -> str:
    """3 significant digits; a bound pushed to zero (E, when the sizes cannot show a floor) as 0."""
    return "0" if abs(value) < 1e-6 else f"{value:.3g}"


def _num(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return (
            f"{value:.{digits}g}"
            if abs(value) < 1e-2 or abs(value) >= 1e4
            else f"{value:.{digits}f}".rstrip("0").rstrip(".")
        )
    return str(value)


def _n(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else f"{n / 1e3:.1f}k"
