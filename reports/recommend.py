"""The recommendation: which configuration to run, what it trades against the reference configs, and how.

The chosen configuration is the validation's ``chosen`` (it saw real runs), else the selection's
first tuned configuration (the knee of the simulated front). The "why" compares it with the
``baseline`` and ``handpicked`` of docs/ARCHITECTURE.md ("Two named reference configs") on both
objectives and on memory, using measured numbers when the validation measured all three and the
simulator's predictions otherwise (never a mix of the two, which would compare a real run with a
simulated one). A difference counts only when it exceeds twice the combined standard error (or
0.5% / 0.005 when no error is known), so noise is not sold as a gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dflash.core.config import DflashConfig
from dflash.model.export_serving import export_command, serving_commands, serving_target
from reports.answer import answer_blocks, decision_of
from reports.document import Bullets, Code, Missing, Section, Table, Text
from reports.fmt import NA, fmt_bytes, fmt_ci, fmt_metric, fmt_pm, num, queue_text
from reports.inputs import Inputs

REFERENCES = ("baseline", "handpicked")
TPUT, MIX, MEM = "throughput_tokens_per_s", "mix_efficiency", "peak_queue_bytes"


@dataclass(frozen=True)
class View:
    """One configuration's numbers on one basis ("measured" or "predicted")."""

    name: str
    queue: dict[str, Any] | None
    mean: dict[str, float | None]
    se: dict[str, float | None]


def chosen_name(inputs: Inputs) -> str | None:
    val = inputs.validation
    decision = decision_of(val.data) if val is not None else None
    if decision is not None and decision.chosen:
        return decision.chosen
    if val is not None and isinstance(val.data.get("chosen"), str):
        return val.data["chosen"]
    if inputs.sweep is not None:
        tuned = [c for c in inputs.sweep.configs if str(c.get("name", "")).startswith("tuned")]
        if tuned:
            return str(tuned[0]["name"])
    return None


def queue_of(inputs: Inputs, name: str) -> dict[str, Any] | None:
    val = inputs.validation
    vc = val.config(name) if val is not None else None
    if vc is not None and vc.queue:
        return vc.queue
    sc = inputs.sweep.config(name) if inputs.sweep is not None else None
    if sc is not None and isinstance(sc.get("queue"), dict):
        return sc["queue"]
    return None


def predicted_view(inputs: Inputs, name: str) -> View | None:
    """The simulator's prediction: the validation's (under its calibration), else the selection's."""
    val = inputs.validation
    sources = []
    if val is not None and val.config(name) is not None:
        sources.append(val.config(name).section("predicted"))
    if inputs.sweep is not None and inputs.sweep.config(name) is not None:
        pred = inputs.sweep.config(name).get("predicted")
        sources.append(pred if isinstance(pred, dict) else {})
    for pred in sources:
        if pred:
            mean = {k: num(v.get("mean")) if isinstance(v, dict) else num(v) for k, v in pred.items()}
            se = {k: num(v.get("se")) if isinstance(v, dict) else None for k, v in pred.items()}
            return View(name, queue_of(inputs, name), mean, se)
    return None


def measured_view(inputs: Inputs, name: str) -> View | None:
    val = inputs.validation
    vc = val.config(name) if val is not None else None
    if vc is None or not vc.section("measured"):
        return None
    return View(name, queue_of(inputs, name), {k: num(v) for k, v in vc.section("measured").items()},
                {k: num(v) for k, v in vc.section("measured_se").items()})


def _differs(a: float, b: float, se_a: float | None, se_b: float | None, floor: float) -> int:
    """+1/-1 when a - b exceeds twice the combined standard error (or ``floor``), else 0."""
    tol = 2 * math.hypot(se_a, se_b) if se_a is not None and se_b is not None else floor
    tol = max(tol, 1e-12)
    return 0 if abs(a - b) <= tol else (1 if a > b else -1)


def tradeoff(ch: View, ref: View) -> str:
    """One sentence: the chosen config against one reference, in numbers."""
    t_c, t_r, m_c, m_r = ch.mean.get(TPUT), ref.mean.get(TPUT), ch.mean.get(MIX), ref.mean.get(MIX)
    if None in (t_c, t_r, m_c, m_r) or not t_r:
        return f"against {ref.name}: not enough numbers to compare"
    dt, dm = (t_c - t_r) / t_r, m_c - m_r
    st = _differs(t_c, t_r, ch.se.get(TPUT), ref.se.get(TPUT), 0.005 * abs(t_r))
    sm = _differs(m_c, m_r, ch.se.get(MIX), ref.se.get(MIX), 0.005)
    verdict = {
        (1, 1): "better on both objectives",
        (0, 1): "a better-mixed diet at the same throughput (within noise)",
        (1, 0): "more throughput at the same mix (within noise)",
        (-1, 1): f"trades {abs(dt):.1%} of throughput for {dm:+.3f} mix_efficiency",
        (1, -1): f"trades {dm:+.3f} mix_efficiency for {dt:+.1%} throughput",
        (0, 0): "no difference beyond the standard errors",
        (-1, 0): "less throughput at the same mix",
        (0, -1): "a less mixed diet at the same throughput",
        (-1, -1): "worse on both objectives",
    }[(st, sm)]
    text = (f"against {ref.name} ({queue_text(ref.queue)}): {verdict} — throughput {fmt_metric(TPUT, t_c)} vs "
            f"{fmt_metric(TPUT, t_r)} tokens/s ({dt:+.1%}), mix_efficiency {fmt_metric(MIX, m_c)} vs "
            f"{fmt_metric(MIX, m_r)} ({dm:+.3f})")
    b_c, b_r = ch.mean.get(MEM), ref.mean.get(MEM)
    if b_c is not None and b_r is not None and b_r > 0:
        text += f", peak queue memory {fmt_bytes(b_c)} vs {fmt_bytes(b_r)} ({b_c / b_r:.2f}x)"
    return text


def command(inputs: Inputs, name: str) -> str | None:
    val = inputs.validation
    if val is not None and isinstance(val.data.get("command"), str) and val.data.get("chosen") == name:
        return val.data["command"]
    q = queue_of(inputs, name)
    if not q:
        return None
    parts = ["dflash train", f"--hs-min-ready {q.get('min_ready')}", f"--hs-max-depth {q.get('max_depth')}"]
    for key, flag in (("policy", "--policy"), ("gate", "--gate"), ("items_per_take", "--items-per-take"),
                      ("max_bytes", "--hs-max-bytes")):
        if q.get(key) is not None:
            parts.append(f"{flag} {q[key]}")
    return " ".join(parts)


def section(inputs: Inputs) -> Section:
    sec = Section("Recommendation", "recommendation")
    name = chosen_name(inputs)
    if name is None:
        sec.blocks.append(Missing("needs a validation directory (validation.json with 'chosen') or a sweep output "
                                  "(selection.json with a tuned configuration)"))
        return sec
    answer = answer_blocks(inputs.validation.data) if inputs.validation is not None else []
    if answer:  # the validation decided (or said it could not): its two sentences and its table come first
        sec.blocks.extend(answer)
        evidence = evidence_blocks(inputs)
        if evidence:  # what the CLI prints under its note too: the hardware's own block comparisons, for reference
            sec.blocks.append(Text("For reference, the hardware alone (the block comparisons of the sequential "
                                   "validation, as the CLI prints them; the decision above is the answer):"))
            sec.blocks.extend(evidence)
    else:
        by = "dflash validate from real runs" if inputs.validation is not None and \
            inputs.validation.data.get("chosen") == name else "the sweep's selection rule on simulated runs"
        sec.blocks.append(Text(f"Run {name}: {queue_text(queue_of(inputs, name))}, chosen by {by}.", strong=True))
        sec.blocks.extend(evidence_blocks(inputs))
    names = shown_names(inputs, name)
    measured = {n: measured_view(inputs, n) for n in names}
    predicted = {n: predicted_view(inputs, n) for n in names}
    use_measured = all(measured.get(n) is not None and measured[n].mean.get(TPUT) is not None
                       for n in (name, *REFERENCES))
    views = measured if use_measured else predicted
    basis = "measured on the real trainer" if use_measured else "predicted by the simulator"
    ch = views[name]
    whys = [tradeoff(ch, views[r]) for r in REFERENCES if r != name and ch is not None and views.get(r) is not None]
    # With a decision its table says why, with intervals; the standard-error rule would be a second verdict.
    if whys and not answer:
        sec.blocks.append(Text(f"Why ({basis}):"))
        sec.blocks.append(Bullets(tuple(w[0].upper() + w[1:] + "." for w in whys)))
    elif not answer:
        sec.blocks.append(Missing(f"the trade-off against baseline and handpicked ({basis}): their numbers are not "
                                  "in the inputs"))
    if inputs.sweep is not None and inputs.sweep.selection.get("rule"):
        sec.blocks.append(Text(f"Selection rule: {inputs.sweep.selection['rule']}."))
    cmd = command(inputs, name)
    if cmd:
        sec.blocks.append(Text("Launch it with:"))
        sec.blocks.append(Code(cmd))
        val = inputs.validation
        if val is not None and val.data.get("best_toml") and val.data.get("chosen") == name:
            sec.blocks.append(Text(f"The configuration file: {val.dir / str(val.data['best_toml'])}"))
        sec.blocks.extend(serving_blocks(inputs, name))
    held = (inputs.validation.data.get("heldout") if inputs.validation is not None else None) or {}
    sec.blocks.append(summary_table(name, measured, predicted, held.get("configs") or {}))
    return sec


def shown_names(inputs: Inputs, name: str) -> list[str]:
    """The recommendation, then every configuration the validation measured (the tuned ones included:
    hiding the one that measured best would hide the evidence), then the references."""
    val = inputs.validation
    validated = [c.name for c in val.configs] if val is not None else []
    return list(dict.fromkeys((name, *validated, *REFERENCES)))


def evidence_blocks(inputs: Inputs) -> list[Text | Bullets]:
    """What the sequential validation resolved: the recommendation in its own words (which carry the
    takes that would settle the rest: one figure, computed once in :func:`tuning.validation.evidence.recommend`,
    the same words the CLI prints), and every comparison of the tested configuration with its 95%
    interval.

    A validation from before sequential blocks has no ``comparisons``: nothing is added, and the
    standard-error rule of :func:`tradeoff` is all the reader gets.
    """
    val = inputs.validation
    comps = val.data.get("comparisons") if val is not None else None
    if not isinstance(comps, list) or not comps:
        return []
    rec = val.data.get("recommendation") or {}
    blocks: list[Text | Bullets] = []
    if rec.get("words"):
        blocks.append(Text(f"The evidence: {rec['words']}"))
    items = []
    for c in comps:
        lo, hi = (c.get("ci95") or [None, None])[:2]
        diff = num(c.get("difference"))
        rng = NA if num(lo) is None or num(hi) is None else f"{num(lo):+.4g} .. {num(hi):+.4g}"
        verdict = "resolved" if c.get("resolved") else "not resolved (the interval holds 0)"
        items.append(f"{c.get('config')} - {c.get('against')} on {c.get('objective')}: "
                     f"{NA if diff is None else f'{diff:+.4g}'}, 95% interval {rng}: {verdict}")
    blocks.append(Text(f"Comparisons after {val.data.get('rounds', NA)} of at most {val.data.get('max_looks', NA)} "
                       f"rounds of {val.data.get('block_takes', NA)} takes (intervals corrected for the looks; "
                       f"stopped: {val.data.get('stopped', NA)}){heldout_caption(val.data.get('heldout'))}:"))
    blocks.append(Bullets(tuple(items)))
    held = val.data.get("heldout")
    if isinstance(held, dict) and held.get("pairs"):
        blocks.append(Text("Held-out comparisons, paired over the same sequences (seeds per side; the interval "
                           "adds the variance between seeds where a configuration has two or more):"))
        blocks.append(Bullets(tuple(paired_item(p) for p in held["pairs"])))
    if isinstance(held, dict) and held.get("note"):
        blocks.append(Text(str(held["note"])))
    return blocks


def paired_item(p: dict[str, Any]) -> str:
    """One paired held-out comparison (validation.json ``heldout.pairs``) in words."""
    lo, hi = (p.get("ci95") or [None, None])[:2]
    rng = NA if num(lo) is None or num(hi) is None else f"{num(lo):+.4g} .. {num(hi):+.4g}"
    seeds = "/".join(str(x) for x in p.get("seeds") or []) or NA
    ratio = num(p.get("width_ratio"))
    return (f"{p.get('config')} - {p.get('against')} on {p.get('objective')}: {num(p.get('difference')) or 0:+.4g}, "
            f"95% interval {rng}, paired, seeds {seeds}"
            + ("" if p.get("claim") else " (one seed: over sequences only, no quality claim)")
            + ("" if ratio is None else f"; paired/independent width over sequences {ratio:.2f}"))


def heldout_caption(held: Any) -> str:
    """Where the held-out comparisons (objectives heldout_tau, heldout_loss) were read, if they were."""
    if not isinstance(held, dict) or not held.get("on") or held.get("step") is None:
        return ""
    if held.get("method") == "paired":
        seeds = held.get("seeds") or {}
        counts = sorted(set(seeds.values()))
        per = NA if not counts else "/".join(str(c) for c in counts)
        return (f"; held-out tau and loss compared once, after step {int(held['step']) + 1} (the last step every "
                f"configuration scored), paired over the same {held.get('sequences', NA)} held-out sequences with "
                f"{per} training seed(s) per configuration, 95% intervals from the paired bootstrap plus the "
                f"variance between seeds")
    return (f"; held-out tau and loss compared once, after step {int(held['step']) + 1} (the last step every "
            f"configuration scored), on the same {held.get('sequences', NA)} held-out sequences, 95% intervals "
            f"from their bootstrap intervals")


def serving_blocks(inputs: Inputs, name: str) -> list[Text | Code]:
    """How the run's drafter reaches a serving engine: ``dflash export`` (checked on load), then the
    SGLang and vLLM commands that serve it next to its target (one home for their text:
    :mod:`dflash.model.export_serving`). Target and block size are the chosen run's, else the
    defaults ``dflash train`` would use; the run directory is the validation's run of the choice."""
    val = inputs.validation
    vc = val.config(name) if val is not None else None
    run = vc.run if vc is not None and vc.run is not None else (inputs.runs[0] if inputs.runs else None)
    cfg = (run.config if run is not None else None) or {}
    defaults = DflashConfig()
    target = (cfg.get("target") or {}).get("model") or defaults.target.model
    block = int((cfg.get("drafter") or {}).get("block_size") or defaults.drafter.block_size)
    run_dir = str(run.dir) if run is not None and run.source == "real" else "RUN_DIR"
    export_dir = f"{run_dir}/export"
    lines = [export_command(run_dir, export_dir)]
    for engine, cmd in serving_commands(export_dir, target, block).items():
        lines += ["", f"# {engine}: the drafter next to {serving_target(target)}", cmd]
    return [Text("Export the trained drafter (z-lab layout, checked on load) and serve it next to its target:"),
            Code("\n".join(lines))]


def summary_table(name: str, measured: dict[str, View | None], predicted: dict[str, View | None],
                  heldout: dict[str, Any] | None = None) -> Table:
    """The chosen configuration and the references side by side; held-out tau and loss (validation.json's
    ``heldout``, at the step they were compared) where the validation scored them."""
    rows = []
    for n in dict.fromkeys((name, *measured, *predicted)):
        m, p = measured.get(n), predicted.get(n)
        if m is None and p is None:
            continue
        q = (m or p).queue if (m or p) is not None else None
        rows.append({
            "config": n + (" (chosen)" if n == name else ""), "queue": queue_text(q),
            "tokens/s measured": fmt_pm(TPUT, *_ms(m, TPUT)), "mix_efficiency measured": fmt_pm(MIX, *_ms(m, MIX)),
            "tokens/s predicted": fmt_pm(TPUT, *_ms(p, TPUT)), "mix_efficiency predicted": fmt_pm(MIX, *_ms(p, MIX)),
            "peak queue memory predicted": fmt_metric(MEM, _ms(p, MEM)[0]),
            "tau measured": fmt_metric("tau", _ms(m, "tau")[0]),
            "held-out tau": fmt_ci((heldout or {}).get(n), "tau", ".3f"),
            "held-out loss": fmt_ci((heldout or {}).get(n), "loss", ".4f"),
        })
    df = pd.DataFrame(rows)
    df = df.loc[:, [c for c in df.columns if c in ("config", "queue") or (df[c] != NA).any()]]
    return Table(df, "Measured: the validation's real trainer runs (± standard error of the measurement); "
                     "predicted: the simulator (± standard error over seeds).")


def _ms(view: View | None, key: str) -> tuple[float | None, float | None]:
    return (None, None) if view is None else (view.mean.get(key), view.se.get(key))
