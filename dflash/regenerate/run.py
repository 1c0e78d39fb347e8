"""``dflash regenerate`` as a sequence of steps: plan the selection, open the back end, generate into the
files, summarise.

The prompts are the configured data set (``workload.dataset``, at most ``workload.max_conversations``
records) read whole (``sample = "conversation"``, whatever ``workload.sample`` says: ``--turns``
decides). ``--limit N`` takes the first N eligible records in data-set order, done ones included, so
a rerun with the same ``--limit`` finishes the same set and a larger one extends it. On start the
ids already in the file are skipped and everything else in the selection is generated, failed
prompts included. A failed prompt is logged and counted, never fatal. Sampled replies depend on the
batch composition (one random stream per run), so only greedy output is reproducible across resumes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DATASET_AUTO, DATASET_PACKAGED, DflashConfig
from dflash.core.errors import ConfigError
from dflash.data.conversations import load_conversations, resolve_dataset, say_damaged
from dflash.data.regenerated_cache import publish, start_work
from dflash.regenerate.options import Options, options_from
from dflash.regenerate.progress import Progress
from dflash.regenerate.prompts import Job, Source, prompt_sources
from dflash.regenerate.sidecar import Session, compare_settings, dataset_identity, run_settings, with_target
from dflash.regenerate.writer import Emit, Existing, Failure, Output, failed_path, inspect_output, sidecar_path

# A back end's generation step: answer the jobs, hand what finished to emit, count on progress.
Generate = Callable[[Iterable[Job], Emit, Progress], None]


@dataclass(frozen=True)
class Plan:
    """What this run is to do: the selection, what the output holds already, and the settings so far."""

    eligible: int
    selected: int
    todo: list[Source]
    existing: Existing
    settings: dict[str, Any]
    selection: dict[str, Any]  # counts for the sidecar


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """``dflash regenerate``: plan, open the back end, generate, summarise (0; 130 when interrupted).
    Without ``--out`` the run writes the target's cache: in its work file, published when finished."""
    opts = options_from(args, cfg)
    source = resume_point(opts)
    plan = plan_run(opts, cfg, source)
    if opts.publish_to is not None and source == opts.publish_to and not plan.todo:
        print(f"regenerate: the cache {opts.publish_to} is complete for this selection ({plan.selected} records); "
              "nothing to do", file=sys.stderr)
        return 0
    generate, target = open_backend(opts, cfg, plan)  # the slow step, and the last place bad input surfaces
    settings = check_target(opts, plan, target)
    if opts.publish_to is not None:
        start_work(opts.publish_to)
    session = Session(opts, settings, target, plan.existing, plan.selection)
    output = Output(opts.out, plan.existing)
    announce(opts, cfg, plan)
    progress = Progress(len(plan.todo))
    status = generate_into(generate, plan.todo, output, session, progress)
    if status == "finished" and opts.publish_to is not None:
        publish(opts.out, opts.publish_to)
    summarise(opts, plan, progress)
    if status == "interrupted":
        kept = " (the cache keeps what it held: nothing is published until the run finishes)" if opts.publish_to \
            else ""
        print(f"interrupted: run the same command again to finish (done records are skipped){kept}", file=sys.stderr)
        return 130
    return 0


def prompt_dataset(value: str) -> str:
    """The prompts' data set: ``"auto"`` means the packaged ShareGPT here (the cache is this verb's output,
    never its input)."""
    return DATASET_PACKAGED if value == DATASET_AUTO else value


def resume_point(opts: Options) -> Path:
    """The file this run continues: ``--out``; in cache mode the work file a killed run left, else the
    published cache (copied to the work file before anything is written), else a fresh work file."""
    if opts.publish_to is None or opts.out.exists() or not opts.publish_to.exists():
        return opts.out
    return opts.publish_to


def plan_run(opts: Options, cfg: DflashConfig, source: Path | None = None) -> Plan:
    """Read the prompts and the existing output (``source``, default ``opts.out``); refuse a file made
    with other settings. Writes nothing."""
    data_path = resolve_dataset(prompt_dataset(cfg.workload.dataset), cfg.target.model)
    convs, stats = load_conversations(data_path, "conversation", cfg.workload.max_conversations)
    say_damaged(data_path, stats)
    sources, ineligible = prompt_sources(convs, opts.turns)
    if not sources:
        raise ConfigError("workload.dataset", "has no record that opens with a user turn (nothing to regenerate)",
                          cfg.workload.dataset)
    selected = sources[: opts.limit] if opts.limit is not None else sources
    settings = run_settings(opts, dataset_identity(data_path, prompt_dataset(cfg.workload.dataset)))
    source = source if source is not None else opts.out
    existing = inspect_output(source)
    if existing.sidecar is not None:
        compare_settings(existing.sidecar["settings"], settings, source, keys=list(settings))
    selection = {"dataset_records": stats.records, "eligible": len(sources), "ineligible": ineligible + stats.skipped,
                 "broken": stats.broken, "selected": len(selected)}
    return Plan(eligible=len(sources), selected=len(selected), todo=[s for s in selected if s.id not in
                                                                      existing.done_ids],
                existing=existing, settings=settings, selection=selection)


def open_backend(opts: Options, cfg: DflashConfig, plan: Plan) -> tuple[Generate | None, dict[str, Any]]:
    """The generation step and the target's identity. With nothing to do locally the target is not
    loaded (its identity comes from the sidecar); a server is always asked, so a rerun checks it."""
    if opts.backend == "server":
        from dflash.regenerate.server import connect, run_server

        client, target = connect(opts)
        return (lambda jobs, emit, progress: run_server(jobs, client, opts.concurrency, emit, progress)), target
    if not plan.todo:
        return None, dict((plan.existing.sidecar or {}).get("target", {}))
    from dflash.regenerate.local import load_local, local_generator

    backend, target = load_local(opts, cfg)
    return local_generator(opts, backend), target


def check_target(opts: Options, plan: Plan, target: dict[str, Any]) -> dict[str, Any]:
    """The settings with the target's identity; a file made by another target is refused."""
    settings = with_target(plan.settings, target)
    sidecar = plan.existing.sidecar
    if sidecar is not None and "target" in sidecar["settings"]:
        compare_settings(sidecar["settings"], settings, opts.out, keys=["target"])
    return settings


def announce(opts: Options, cfg: DflashConfig, plan: Plan) -> None:
    if plan.existing.torn_bytes:
        print(f"regenerate: cut a partial last line ({plan.existing.torn_bytes} bytes) off {opts.out}",
              file=sys.stderr)
    decoding = f"temperature {opts.temperature:g}, top_p {opts.top_p:g}" if opts.sampling else "greedy"
    print(f"regenerate: {plan.selected} records selected ({plan.selected - len(plan.todo)} already in {opts.out}, "
          f"{len(plan.todo)} to do; {plan.eligible} eligible of {plan.selection['dataset_records']} in "
          f"{cfg.workload.dataset}); backend {opts.backend}, turns {opts.turns}, max_new_tokens "
          f"{opts.max_new_tokens}, {decoding}", file=sys.stderr, flush=True)


def generate_into(generate: Generate | None, todo: list[Source], output: Output, session: Session,
                  progress: Progress) -> str:
    """Run the back end, appending what finishes; the run's status ("finished", "interrupted") ends
    up in the sidecar, "crashed" when anything else stopped it."""

    def emit(records: list[dict[str, Any]], failures: list[Failure]) -> None:
        output.write(records)
        output.log_failures(failures)
        session.write(progress, force=False)

    status = "finished"
    session.write(progress)
    try:
        if generate is not None:
            generate((Job(s) for s in todo), emit, progress)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        output.close()
        session.write(progress, status=status if sys.exc_info()[0] in (None, KeyboardInterrupt) else "crashed")
        progress.maybe_print(force=True)
    return status


def summarise(opts: Options, plan: Plan, progress: Progress) -> None:
    pps, tps = progress.rates()
    total = plan.existing.records + progress.records
    failed = f" (see {failed_path(opts.out)})" if progress.failed else ""
    where = opts.publish_to if opts.publish_to is not None and opts.publish_to.exists() and not opts.out.exists() \
        else opts.out
    print(f"regenerated {progress.records} records ({progress.replies} replies, {progress.tokens} new tokens) in "
          f"{progress.elapsed:.1f} s: {pps:.3f} prompts/s, {tps:.1f} tokens/s; {progress.failed} failed{failed}, "
          f"{progress.skipped} skipped (prompt over workload.max_len); {where} holds {total} records")
    if where == opts.publish_to:
        print(f"published: [workload] dataset = \"auto\" trains on it (the CPU profiles do); settings in "
              f"{sidecar_path(where)}")
    else:
        print(f"train on it: [workload] dataset = \"{where}\"; settings in {sidecar_path(where)}")
