"""Number formatting and Markdown tables: one rounding rule for every number the report shows.

The report is read next to its inputs, so a reader (and the tests) must be able to predict every
printed number from the JSON it came from. The rules, also printed at the end of the report:

- ``throughput_tokens_per_s``: whole tokens with thousands separators (``38,894``);
- ``samples_per_s``: 2 decimals (CPU runs do a few samples per second);
- ``peak_queue_bytes``/``mean_queue_bytes``: GiB with 2 decimals, or MiB with 1 decimal under 1 GiB;
- ``mean_queue_depth``: 1 decimal; ``max_bucket_streak`` and counts: whole numbers;
- relative errors: percent with a sign and 1 decimal (``+3.2%``);
- everything else (efficiencies, entropies, fractions, KL, autocorrelation, tau, loss roughness):
  3 decimals;
- calibration tables, which are shown as they are: 6 significant digits.

Missing values (``None``, NaN, absent keys) print as ``n/a``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

NA = "n/a"
GIB = 2**30
MIB = 2**20

ROUNDING_NOTE = (
    "Rounding: tokens/s to whole tokens; samples/s to 2 decimals; queue bytes in GiB (2 decimals) or MiB "
    "(1 decimal, under 1 GiB); mean queue depth to 1 decimal; streaks and counts to whole numbers; "
    "relative errors in percent with 1 decimal; every other metric to 3 decimals; calibration values to 6 "
    "significant digits. n/a: not in the inputs."
)

# The metric names of docs/ARCHITECTURE.md ("Metrics"), in the order tables list them.
METRICS = (
    "throughput_tokens_per_s", "samples_per_s", "mix_efficiency", "mix_entropy", "mix_kl", "length_autocorr",
    "max_bucket_streak", "drafter_utilization", "target_utilization", "drafter_gate_wait_frac",
    "producer_blocked_frac", "mean_queue_depth", "peak_queue_bytes", "loss_roughness", "tau",
)


def num(value: Any) -> float | None:
    """A finite float, or None for anything missing or not a finite number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt_bytes(value: Any, like: Any = None) -> str:
    """GiB (2 decimals) from 1 GiB up, else MiB (1 decimal); ``like``: take the unit that value would get."""
    x = num(value)
    if x is None:
        return NA
    ref = num(like) if num(like) is not None else x
    return f"{x / GIB:.2f} GiB" if abs(ref) >= GIB else f"{x / MIB:.1f} MiB"


def fmt_metric(name: str, value: Any) -> str:
    """``value`` of metric ``name`` by the module's rounding rule."""
    x = num(value)
    if x is None:
        return NA
    if name == "throughput_tokens_per_s":
        return f"{x:,.0f}"
    if name == "samples_per_s":
        return f"{x:,.2f}"
    if name.endswith("_bytes"):
        return fmt_bytes(x)
    if name == "mean_queue_depth":
        return f"{x:.1f}"
    if name in ("max_bucket_streak", "steps", "takes", "trials"):
        return f"{x:,.0f}"
    return f"{x:.3f}"


def fmt_pm(name: str, mean: Any, se: Any) -> str:
    """``mean ± se`` (the ± part only when the standard error is known; bytes: se in the mean's unit)."""
    m = fmt_metric(name, mean)
    if m == NA:
        return NA
    s = fmt_bytes(se, like=mean) if name.endswith("_bytes") else fmt_metric(name, se)
    return m if s == NA else f"{m} ± {s}"


def fmt_rel(value: Any) -> str:
    x = num(value)
    return NA if x is None else f"{x:+.1%}"


def md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of a DataFrame of strings (pandas' to_markdown needs tabulate)."""
    cols = [md_escape(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(md_escape(v) for v in row) + " |")
    return "\n".join(lines)


def parse_md_table(text: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``text`` (used by the tests and by nobody else)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
            rows.append(cells)
        elif rows:
            break
    if len(rows) < 2:
        return []
    head = rows[0]
    return [dict(zip(head, r)) for r in rows[2:]]


def queue_text(queue: dict[str, Any] | None) -> str:
    """``10/30 random_item threshold`` (min_ready/max_depth policy gate, plus take size and byte cap if set)."""
    if not queue:
        return NA
    text = f"{queue.get('min_ready', '?')}/{queue.get('max_depth', '?')} {queue.get('policy', '?')}"
    if queue.get("gate"):
        text += f" {queue['gate']}"
    if queue.get("items_per_take") not in (None, 1):
        text += f", {queue['items_per_take']} per take"
    if queue.get("max_bytes"):
        text += f", max {fmt_bytes(queue['max_bytes'])}"
    return text


def join(parts: Sequence[str], sep: str = "; ") -> str:
    return sep.join(p for p in parts if p)


def fmt_ci(h: Any, key: str, spec: str) -> str:
    """``value [lo, hi]`` of a held-out object's figure (``key`` and ``key_ci``), or n/a."""
    v = num(h.get(key)) if isinstance(h, dict) else None
    if v is None:
        return NA
    ci = [num(x) for x in (h.get(f"{key}_ci") or [])[:2]]
    return format(v, spec) + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if len(ci) == 2 and None not in ci else "")
