"""``dflash validate``'s job: claim and run blocks, round by round, then write the summary.

Several workers share the claim table (:mod:`tuning.validation.claims`) per (configuration, block).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from dflash.core.config import DflashConfig
from tuning.validation.claims import ClaimStore, worker_id
from tuning.validation.metrics import block_table, peak_bytes
from tuning.validation.plan import (
    ValidateArgs,
    job_namespace,
    max_looks,
    split_unit,
    unit_order,
    unit_ready,
)
from tuning.validation.runner import HELD, release, run_block
from tuning.validation.summary import write_summary


def run_validation(base: DflashConfig, args: ValidateArgs, progress: Callable[[str], None] = print
                   ) -> dict[str, Any] | None:
    """Claim and run blocks, round by round, until the evidence is in or the budget is spent; the
    summary when this worker is the one to write it.

    Several workers share the claim table *per (configuration, block)*: block k of every config is
    claimable once round k-1 is over, so the rounds stay ABC ABC... whoever runs them (the output
    directory must be shared: a block continues its config's checkpoint). The worker that finishes
    a round looks at the evidence and, when every comparison is resolved, skips what is left.
    """
    from simulator.calibration import apply_calibration

    base.cluster.check_trainable()  # before anything is written: a sharded target is simulator-only
    preflight(base, force=args.force)
    calibrated = apply_calibration(base, args.calibration)
    args.out.mkdir(parents=True, exist_ok=True)
    store = ClaimStore(args.claims_url, job_namespace(args, base))
    entries = {c["name"]: c for c in args.selection["configs"]}
    looks = max_looks(args.takes, args.block_takes)
    store.register(unit_order(list(entries), looks))
    me = worker_id()
    unit = None
    try:
        while (unit := _next_unit(store, me)) is not None:
            name, block = split_unit(unit)
            row, status = _run_claimed(store, unit, me, partial(run_block, entries[name], block, base, args, progress))
            kept = store.finish(unit, me, row, status)
            rows = store.rows()
            finished = sum(r["status"] in ("done", "failed", "skipped") for r in rows)
            progress(block_line(row, entries[name]["queue"], looks, finished, len(rows)))
            if not kept:
                progress(f"{unit}: claim lost to another worker (this one was taken for dead); result dropped")
            look_after_round(store, block, looks, progress, base, calibrated, args)
        rows = store.rows()
        release()  # held jobs end the normal way: their metrics.json and drafter are read below
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the jobs checkpoint first, then the block is given back
        _kill_held()
        if unit is not None:
            store.release(unit, me)  # a rerun runs it again at once (resuming the checkpoint)
        raise
    finally:
        store.close()
        _kill_held()  # an error: stop with a checkpoint (a rerun resumes it)
    return write_summary(base, calibrated, args, rows, progress)


def preflight(cfg: DflashConfig, *, force: bool = False) -> None:
    """The validation's jobs run here, every rank of each on this node: each device must hold the roles
    placed on it (CUDA's total memory, the host's available memory for CPU ranks), as ``dflash train``
    checks; refused in one line (exit 2) unless ``force`` (``--force``)."""
    from dflash.pipeline.hostmem import check_node_fits

    check_node_fits(cfg, cfg.cluster.n_target + cfg.cluster.n_drafter, force=force)


def _kill_held() -> None:
    """Every held job stopped with a checkpoint: all are told at once, then each is waited for (a
    scheduler's grace period covers one checkpoint, not one per configuration)."""
    for job in list(HELD.values()):
        job.terminate()
    for job in list(HELD.values()):
        job.kill()
    HELD.clear()


def block_line(row: dict[str, Any], queue: dict[str, Any], looks: int, done: int, total: int, width: int = 20
               ) -> str:
    """One line per block: a bar over the whole validation, the config, its block, steps, tokens/s and
    queue depth (or why the block failed)."""
    filled = round(width * done / total) if total else width
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
    knobs = f"{queue.get('min_ready')}/{queue.get('max_depth')} {queue.get('policy') or ''}".rstrip()
    head = f"{bar} {row['name']} ({knobs}) block {row['block'] + 1}/{looks}"
    if "error" in row:
        return f"{head}: FAILED ({row['error']})"

    def num(key: str, spec: str) -> str:
        v = row.get(key)
        return "n/a" if v is None else format(v, spec)

    return (f"{head}: steps {row.get('steps')}, tokens/s {num('throughput_tokens_per_s', ',.0f')}, queue depth "
            f"{num('mean_queue_depth', '.1f')} (mean), mix_efficiency {num('mix_efficiency', '.3f')}")


def _next_unit(store: ClaimStore, me: str, poll_s: float = 2.0) -> str | None:
    """The next claimable block; waits while other workers finish the round it depends on."""
    while True:
        unit = store.claim(me, ready=unit_ready)
        if unit is not None:
            return unit
        rows = store.rows()
        if not any(r["status"] == "running" for r in rows):
            store.skip_pending()  # nothing runs and nothing is ready: a config failed before its turn
            return None
        time.sleep(poll_s)


def _run_claimed(store: ClaimStore, unit: str, me: str, work: Callable[[], dict[str, Any]]
                 ) -> tuple[dict[str, Any], str]:
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(store, unit, me, stop), daemon=True)
    beat.start()
    try:
        return work(), "done"
    except Exception as exc:
        return {"name": split_unit(unit)[0], "block": split_unit(unit)[1],
                "error": f"{type(exc).__name__}: {exc}"}, "failed"
    finally:
        stop.set()
        beat.join()


def look_after_round(store: ClaimStore, block: int, looks: int, progress: Callable[[str], None],
                     base: DflashConfig, calibrated: DflashConfig, args: ValidateArgs) -> None:
    """After the last block of a round: stop early when the decision the summary would make now
    (:func:`interim_decision`) is already an answer, decided or equivalent.

    The decision's level is already split over every look (``max_looks``), so stopping at any look keeps
    the overall level (Bonferroni over looks). With the held-out quality objective on, nothing stops
    early: those scores exist only once the jobs end."""
    rows = store.rows()
    if block + 1 >= looks or any(split_unit(r["name"])[1] == block and r["status"] in ("pending", "running")
                                 for r in rows):
        return
    if base.train.quality_every:
        return
    decision = interim_decision(base, calibrated, args, [r["result"] for r in rows if r["status"] == "done"], looks)
    if decision is not None and decision.outcome in ("decided", "equivalent") and (n := store.skip_pending()):
        progress(f"look {block + 1}/{looks}: {decision.outcome} on {decision.chosen} at the split level; "
                 f"{n} blocks skipped")


def interim_decision(base: DflashConfig, calibrated: DflashConfig, args: ValidateArgs,
                     done: list[dict[str, Any]], looks: int) -> Any:
    """The decision over the blocks done so far, as the summary makes it (the same predictions of the same
    blocks, the same policy); block objectives only. None when fewer than two configurations have blocks."""
    from tuning.validation.recommendation import decide_validation
    from tuning.validation.summary import predicted_blocks

    entries = {c["name"]: c for c in args.selection["configs"]}
    by_name = {n: [r for r in done if r.get("name") == n and "error" not in r] for n in entries}
    by_name = {n: rs for n, rs in by_name.items() if rs}
    if len(by_name) < 2:
        return None
    configs = []
    for n, rs in by_name.items():
        _steps, kept, _spans, predicted = predicted_blocks(entries[n], rs, base, calibrated, args)
        configs.append({"name": n, "kept_blocks": kept, "predicted": predicted})
    blocks = block_table([r for rs in by_name.values() for r in rs])
    peak = peak_bytes(blocks)
    return decide_validation(base.decision, looks, configs, by_name, {}, peak)


def _beat(store: ClaimStore, name: str, me: str, stop: threading.Event) -> None:
    while not stop.wait(30.0):
        with contextlib.suppress(Exception):  # a missed beat is retried; the run goes on
            store.heartbeat(name, me)
