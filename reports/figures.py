"""The report's figures, drawn with matplotlib's Agg backend into PNG bytes.

Figures are returned as bytes, not written, so the report can embed them (base64) and write them
beside the Markdown only once every section has been built: a failure half-way leaves no files.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from reports.runs import RunData, bucket_labels, depth_series, heldout_series, loss_series, rolling_mix

GIB = 2**30
DPI = 100


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit; also what the simulator's plot uses
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _plt().close(fig)
    return buf.getvalue()


def _finite(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


@dataclass(frozen=True)
class Marked:
    """A named configuration drawn on the Pareto plot (predicted mean and standard error)."""

    label: str
    throughput: float
    throughput_se: float
    mix: float
    mix_se: float
    marker: str


# --------------------------------------------------------------------------- sweep
def pareto(trials: pd.DataFrame, front: Sequence[int], feasible: dict[int, bool] | None,
           marked: Sequence[Marked]) -> bytes:
    """Every complete trial (colour: peak queue GiB), the front with error bars, named configs marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.6), constrained_layout=True)
    x = trials["user_attrs_throughput_tokens_per_s"].map(_finite)
    y = trials["user_attrs_mix_efficiency"].map(_finite)
    mem = trials.get("user_attrs_peak_queue_bytes", pd.Series(np.nan, index=trials.index)).map(_finite) / GIB
    ok = trials["number"].map(lambda n: True if feasible is None else feasible.get(int(n), False))
    vmin, vmax = (float(np.nanmin(mem)), float(np.nanmax(mem))) if mem.notna().any() else (0.0, 1.0)
    sc = ax.scatter(x[ok], y[ok], c=mem[ok], cmap="viridis", vmin=vmin, vmax=vmax, s=22, alpha=0.75,
                    label="feasible trial" if feasible is not None else "trial (feasibility unknown)")
    if (~ok).any():
        ax.scatter(x[~ok], y[~ok], marker="x", color="0.6", s=20, label="infeasible trial")
    on = trials["number"].isin(list(front))
    if on.any():
        f = trials[on].sort_values("user_attrs_throughput_tokens_per_s")
        fx, fy = f["user_attrs_throughput_tokens_per_s"].map(_finite), f["user_attrs_mix_efficiency"].map(_finite)
        xerr = f.get("user_attrs_throughput_tokens_per_s_se", pd.Series(np.nan, index=f.index)).map(_finite)
        yerr = f.get("user_attrs_mix_efficiency_se", pd.Series(np.nan, index=f.index)).map(_finite)
        ax.errorbar(fx, fy, xerr=xerr.fillna(0), yerr=yerr.fillna(0), fmt="none", ecolor="black", elinewidth=0.8,
                    capsize=2, zorder=3)
        ax.plot(fx, fy, color="black", lw=0.8, zorder=3)
        ax.scatter(fx, fy, c=(f["user_attrs_peak_queue_bytes"].map(_finite) / GIB
                              if "user_attrs_peak_queue_bytes" in f else None),
                   cmap="viridis", vmin=vmin, vmax=vmax, s=70, edgecolors="black", linewidths=1.2, zorder=4,
                   label=f"Pareto front ({int(on.sum())})")
    colours = {"s": "tab:red", "D": "tab:orange", "*": "magenta"}
    for m in marked:
        if math.isnan(m.throughput) or math.isnan(m.mix):
            continue
        ax.errorbar([m.throughput], [m.mix], xerr=[0 if math.isnan(m.throughput_se) else m.throughput_se],
                    yerr=[0 if math.isnan(m.mix_se) else m.mix_se], fmt=m.marker,
                    color=colours.get(m.marker, "tab:red"), ms=13 if m.marker == "*" else 9,
                    mec="black", capsize=3, zorder=5, label=m.label)
        ax.annotate(m.label, (m.throughput, m.mix), textcoords="offset points", xytext=(8, 6), fontsize=8)
    fig.colorbar(sc, ax=ax, label="peak queue memory (GiB)")
    ax.set_xlabel("throughput (tokens/s), simulated")
    ax.set_ylabel("mix_efficiency, simulated")
    ax.set_title("Sweep: throughput vs mix_efficiency (mean ± standard error over seeds)")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def _bins(values: pd.Series, max_bins: int = 8) -> tuple[pd.Series, list[str]]:
    """Categorical bins of an integer knob: its own values when few, else equal-width ranges."""
    v = values.astype(float)
    uniq = sorted(v.dropna().unique())
    if len(uniq) <= max_bins:
        labels = [f"{u:g}" for u in uniq]
        return v.map(lambda z: labels[uniq.index(z)] if z in uniq else None), labels
    edges = np.linspace(min(uniq), max(uniq), max_bins + 1)
    idx = np.clip(np.searchsorted(edges, v, side="right") - 1, 0, max_bins - 1)
    labels = []
    for i in range(max_bins):  # integer range of bin i: [edges[i], edges[i+1]), the last one closed
        lo = math.ceil(edges[i])
        hi = math.floor(edges[i + 1]) if i == max_bins - 1 else math.ceil(edges[i + 1]) - 1
        labels.append(f"{lo}" if hi <= lo else f"{lo}-{hi}")
    return pd.Series([labels[i] for i in idx], index=v.index), labels


def binned(trials: pd.DataFrame) -> tuple[pd.DataFrame, list[str], list[str]]:
    """trials with ``mr_bin``/``md_bin`` columns (effective min_ready/max_depth) and the bin labels."""
    df = trials.copy()
    df["mr_bin"], mr_labels = _bins(df["user_attrs_queue_min_ready"])
    df["md_bin"], md_labels = _bins(df["user_attrs_queue_max_depth"])
    return df, mr_labels, md_labels


def heatmaps(trials: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> bytes:
    """Mean of each objective over (min_ready bin, max_depth bin), one row of panels per policy."""
    plt = _plt()
    df, mr_labels, md_labels = binned(trials)
    policies = sorted(df["user_attrs_queue_policy"].dropna().unique())
    rows, cols = max(len(policies), 1), len(objectives)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.2 * rows + 0.6), squeeze=False,
                             constrained_layout=True)
    for j, (col, title) in enumerate(objectives):
        vals = df[col].map(_finite)
        vmin, vmax = (float(np.nanmin(vals)), float(np.nanmax(vals))) if vals.notna().any() else (0.0, 1.0)
        for i, pol in enumerate(policies):
            ax = axes[i][j]
            sub = df[df["user_attrs_queue_policy"] == pol]
            grid = np.full((len(mr_labels), len(md_labels)), np.nan)
            for (mr, md), g in sub.groupby(["mr_bin", "md_bin"]):
                grid[mr_labels.index(mr), md_labels.index(md)] = np.nanmean(g[col].map(_finite))
            im = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap="viridis",
                           vmin=vmin, vmax=vmax)
            if grid.size <= 100:
                for (a, b), v in np.ndenumerate(grid):
                    if np.isfinite(v):
                        ax.text(b, a, f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}", ha="center", va="center",
                                fontsize=6, color="white" if v < (vmin + vmax) / 2 else "black")
            ax.set_xticks(range(len(md_labels)), md_labels, rotation=45, fontsize=7)
            ax.set_yticks(range(len(mr_labels)), mr_labels, fontsize=7)
            ax.set_xlabel("max_depth")
            ax.set_ylabel("min_ready")
            ax.set_title(f"{title} — {pol}", fontsize=9)
            fig.colorbar(im, ax=ax, shrink=0.85)
    return _png(fig)


# --------------------------------------------------------------------------- runs
Row = tuple[str, RunData | None, RunData | None]  # (label, simulated, measured)


def _cell_missing(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def row_columns(rows: Sequence[Row]) -> list[tuple[int, str]]:
    """The columns worth drawing: simulated and/or measured, whichever some row has (a report of real
    runs alone has no empty simulated column)."""
    return [(j, kind) for j, kind in ((0, "simulated"), (1, "measured")) if any(r[1 + j] is not None for r in rows)]


def columns_text(rows: Sequence[Row]) -> str:
    cols = [kind for _, kind in row_columns(rows)]
    return "left simulated, right measured" if len(cols) == 2 else f"{cols[0]} runs" if cols else "no runs"


def _sim_vs_real(rows: Sequence[Row], row_height: float, draw: Callable[[Any, RunData], str | None]) -> bytes:
    """One figure row per config, simulated | measured side by side (only the columns some row has);
    ``draw`` fills one cell and returns None, or a reason the cell is empty."""
    plt = _plt()
    cols = row_columns(rows)
    fig, axes = plt.subplots(len(rows), max(1, len(cols)), figsize=(11 if len(cols) > 1 else 6.5,
                                                                    row_height * len(rows) + 0.4),
                             squeeze=False, constrained_layout=True)
    for i, (label, *runs) in enumerate(rows):
        for col, (j, kind) in enumerate(cols):
            run = runs[j]
            ax = axes[i][col]
            ax.set_title(f"{label} — {kind}", fontsize=9)
            missing = f"not {kind}" if run is None else draw(ax, run)
            if missing:
                _cell_missing(ax, missing)
            elif i == 0:
                ax.legend(loc="upper right", fontsize=6, ncol=run.n_buckets + 1)
    return _png(fig)


def queue_depth(rows: Sequence[Row]) -> bytes:
    """Stacked per-bucket depth (total line on top) seen at each take; simulated | measured per row."""

    def draw(ax: Any, run: RunData) -> None:
        k = run.n_buckets
        t, total, per = depth_series(run.takes, k)
        ax.stackplot(t, per, labels=bucket_labels(run.bucket_bounds, k), step="post", alpha=0.85)
        ax.step(t, total, where="post", color="black", lw=0.7, label="total")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("depth (items)")

    return _sim_vs_real(rows, 2.6, draw)


def bucket_mix(rows: Sequence[Row]) -> bytes:
    """Bucket shares of each window of W taken items; simulated | measured per row."""

    def draw(ax: Any, run: RunData) -> str | None:
        k, w = run.n_buckets, run.window
        fr = rolling_mix(run.takes, w, k)
        n_win = len(fr[0]) if fr else 0
        if n_win == 0:
            return f"fewer than {w} taken items"
        ax.stackplot(range(n_win + 1), [f + f[-1:] for f in fr], labels=bucket_labels(run.bucket_bounds, k),
                     step="post", alpha=0.85)
        ax.set_xlim(0, n_win)
        ax.set_ylim(0, 1)
        ax.set_xlabel(f"window of {w} taken items")
        ax.set_ylabel("bucket share")
        return None

    return _sim_vs_real(rows, 2.4, draw)


def loss_curves(curves: Sequence[tuple[str, RunData]]) -> bytes:
    """Per-step training loss of each measured run (thin), and its running mean over 10 logged losses."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.2), constrained_layout=True)
    for label, run in curves:
        xs, ys = loss_series(run.steps)
        line = ax.plot(xs, ys, lw=0.7, alpha=0.45)[0]
        if len(ys) >= 10:
            smooth = np.convolve(ys, np.ones(10) / 10, mode="valid")
            ax.plot(xs[9:], smooth, lw=1.6, color=line.get_color(), label=label)
        else:
            line.set_label(label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss, measured")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def heldout_curves(curves: Sequence[tuple[str, RunData]]) -> bytes:
    """Held-out tau and held-out loss of each run over steps, each with its 95% interval as a band."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0), constrained_layout=True)
    for label, run in curves:
        pts = heldout_series(run.steps)
        xs = [s + 1 for s, _ in pts]  # after step s: s + 1 steps trained
        for ax, key in zip(axes, ("tau", "loss"), strict=True):
            ys = [_finite(h.get(key)) for _, h in pts]
            ci = [h.get(f"{key}_ci") or [None, None] for _, h in pts]
            line = ax.plot(xs, ys, marker="o", ms=3, lw=1.4, label=label)[0]
            ax.fill_between(xs, [_finite(c[0]) for c in ci], [_finite(c[1]) for c in ci], color=line.get_color(),
                            alpha=0.2)
    for ax, what in zip(axes, ("held-out tau (serving walk; higher is better)",
                               "held-out loss (weighted block CE; lower is better)"), strict=True):
        ax.set_xlabel("steps trained")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _png(fig)


def split(trials: pd.DataFrame, table: dict[str, Any]) -> bytes:
    """Throughput and mix_efficiency against the GPU split: every feasible trial faint, each split's
    choice (its queue knobs re-optimised) joined by a line; the best and the even split marked."""
    plt = _plt()
    splits = [s for s in table["splits"]]
    labels = [f"{s['n_target']}/{s['n_drafter']}" for s in splits]
    pos = {s["n_target"]: i for i, s in enumerate(splits)}
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True, constrained_layout=True)
    best, even = table.get("best"), table.get("even")
    for ax, col, name in ((axes[0], "user_attrs_throughput_tokens_per_s", "throughput (tokens/s)"),
                          (axes[1], "user_attrs_mix_efficiency", "mix_efficiency")):
        key = col.removeprefix("user_attrs_")
        ok = trials[trials["split_feasible"]]
        ax.scatter(ok["split_targets"].map(pos), ok[col].map(_finite), s=12, color="0.6", alpha=0.6,
                   label="feasible trial")
        xs = [pos[s["n_target"]] for s in splits if s[key] is not None]
        ys = [s[key] for s in splits if s[key] is not None]
        ax.plot(xs, ys, "o-", color="tab:blue", label="each split's choice (knobs re-optimised)")
        for s, marker, colour, label in ((even, "D", "tab:orange", "even split"), (best, "*", "magenta", "best split")):
            if s is not None and s[key] is not None:
                ax.plot([pos[s["n_target"]]], [s[key]], marker, color=colour, ms=14 if marker == "*" else 9,
                        mec="black", label=label, zorder=5)
        for s in splits:
            if s["trial"] is None:
                ax.axvspan(pos[s["n_target"]] - 0.4, pos[s["n_target"]] + 0.4, color="0.9", zorder=0)
        ax.set_ylabel(f"{name}, simulated")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[1].set_xticks(range(len(labels)), labels)
    axes[1].set_xlabel("split: target workers / drafter workers (grey: no feasible trial)")
    axes[0].set_title("Throughput and mix against the GPU split")
    return _png(fig)


# --------------------------------------------------------------------------- per-run panels
def autopilot(label: str, run: RunData, knobs: dict[str, tuple[list[float], list[float]]],
              changes: Sequence[dict[str, Any]]) -> bytes:
    """Knobs over time, the rolling bucket mix at each window's last take, and the mix each decision
    measured (with its interval and the target), on one time axis."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.2), sharex=True, constrained_layout=True,
                             gridspec_kw={"height_ratios": [1.2, 1.2, 1]})
    for name, (ts, vs) in knobs.items():
        if ts:
            axes[0].step(ts, vs, where="post", label=name, lw=1.4)
    axes[0].set_ylabel("items")
    axes[0].set_title(f"{label}: queue knobs", fontsize=9)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].grid(alpha=0.3)
    k, w = run.n_buckets, run.window
    fr = rolling_mix(run.takes, w, k)
    ends = _window_end_times(run.takes, w)
    if fr and fr[0]:
        n = min(len(fr[0]), len(ends))
        axes[1].stackplot(ends[:n], [f[:n] for f in fr], labels=bucket_labels(run.bucket_bounds, k), step="post",
                          alpha=0.85)
        axes[1].set_ylim(0, 1)
        axes[1].legend(fontsize=6, loc="upper right", ncol=k)
    else:
        _cell_missing(axes[1], f"fewer than {w} taken items")
    axes[1].set_ylabel(f"bucket share (W={w})")
    pts = [(float(c["t"]), c["reason"]) for c in changes if isinstance(c.get("reason"), dict)
           and c["reason"].get("mix_efficiency") is not None]
    if pts:
        ts = [t for t, _ in pts]
        ys = [_finite(r["mix_efficiency"]) for _, r in pts]
        lo = [y - _finite((r.get("interval") or [y, y])[0]) for y, (_, r) in zip(ys, pts)]
        hi = [_finite((r.get("interval") or [y, y])[1]) - y for y, (_, r) in zip(ys, pts)]
        axes[2].errorbar(ts, ys, yerr=[lo, hi], fmt="o", ms=3, lw=0.8, capsize=2, label="measured at decision")
        targets = {_finite(r.get("target")) for _, r in pts if r.get("target") is not None}
        for tgt in targets:
            axes[2].axhline(tgt, ls="--", color="0.3", lw=0.9, label=f"target {tgt:.3f}")
        axes[2].legend(fontsize=8, loc="lower right")
    else:
        _cell_missing(axes[2], "the change records state no measured mix")
    axes[2].set_ylabel("mix_efficiency")
    axes[2].set_xlabel("time (s)" + (", simulated" if run.source == "sim" else ", wall"))
    axes[2].grid(alpha=0.3)
    return _png(fig)


def _window_end_times(takes: Sequence[dict[str, Any]], window: int) -> list[float]:
    """The time of the take that completes each consecutive window of ``window`` items."""
    out, n = [], 0
    for r in takes:
        for _ in r.get("item_ids") or [None]:
            n += 1
            if n % window == 0:
                out.append(float(r["t"]))
    return out


def stages(runs: Sequence[tuple[str, dict[str, float], float | None]], compound: set[str]) -> bytes:
    """One horizontal bar per run, stacked by stage (mean seconds per step); compound stages left out."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.6 * len(runs)), constrained_layout=True)
    names = list(dict.fromkeys(k for _, m, _ in runs for k in m if k not in compound))
    for j, (_, means, step_s) in enumerate(runs):
        left = 0.0
        for i, k in enumerate(names):
            v = means.get(k, 0.0)
            ax.barh(j, v, left=left, color=f"C{i}", label=k if j == 0 else None)
            left += v
        if step_s is not None and step_s > left:
            ax.barh(j, step_s - left, left=left, color="0.85", label="other" if j == 0 else None)
    ax.set_yticks(range(len(runs)), [r[0] for r in runs], fontsize=8)
    ax.set_xlabel("mean seconds per step")
    ax.legend(fontsize=7, ncol=min(6, len(names) + 1), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def gpu(runs: Sequence[tuple[str, RunData, pd.DataFrame]]) -> bytes:
    """Utilisation (top) and power (bottom) of each (run, rank, GPU) over time."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, constrained_layout=True)
    for label, _, df in runs:
        for (rank, g), sub in df.groupby(["rank", "gpu"]):
            for ax, col in ((axes[0], "util"), (axes[1], "power_w")):
                if col in sub and sub[col].notna().any():
                    ax.plot(sub["t"], sub[col], marker=".", lw=1, label=f"{label} rank {rank} GPU {g}")
    axes[0].set_ylabel("utilisation (%)")
    axes[1].set_ylabel("power (W)")
    axes[1].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _png(fig)
