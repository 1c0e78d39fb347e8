"""What one validation job is: its arguments, its selection, its identity and its units.

A job validates every configuration of a selection (the sweep's top-k plus ``baseline`` and
``handpicked``) in blocks of takes. A *unit* is one block of one configuration (``name#k``); units
run round-major (every configuration's block k before any block k+1) so slow machine drift hits all
configurations alike, and the number of rounds (looks at the evidence) is fixed before the first block.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError


@dataclass(frozen=True)
class ValidateArgs:
    selection: dict[str, Any]
    selection_path: str
    takes: int
    out: Path
    calibration: str | None
    claims_url: str
    prompts: int
    block_takes: int = 10
    block_reason: str = "given by the caller"  # why blocks are this long (validation.json's block_reason)
    force: bool = False  # --force: run even where the memory model says a device would not hold the jobs


def read_selection(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--selection", f"must be a readable selection.json ({type(exc).__name__})",
                          str(path)) from None
    configs = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("queue"), dict)
            for c in configs):
        raise ConfigError("--selection", "must hold a non-empty 'configs' list of {name, queue} (dflash sweep "
                                         "writes one)", str(path))
    if not any(_valid_queue(c["queue"]) for c in configs):
        raise ConfigError("--selection", "holds no config with a valid queue table "
                          "(see docs/ARCHITECTURE.md's queue keys)", str(path))
    return data


def _valid_queue(queue: dict[str, Any]) -> bool:
    from dflash.core.config import QueueConfig

    try:
        QueueConfig(**{k: v for k, v in queue.items() if v is not None})
    except (ConfigError, TypeError, ValueError):
        return False
    return True


def selection_from_study(study_name: str, storage: str, cfg: DflashConfig) -> dict[str, Any]:
    """Top-k of a stored study plus the named configs, like the sweep's own selection.json."""
    import optuna

    from tuning.select import NAMED, named_params, select_top_k, tuned_entries
    from tuning.space import effective_queue

    try:
        study = optuna.load_study(study_name=study_name, storage=_optuna_storage(storage))
    except KeyError:
        raise ConfigError("--study", f"no study of that name in {storage}", study_name) from None
    configs = tuned_entries(select_top_k(study, cfg.sweep.top_k))
    for name in NAMED:
        params = named_params(name)
        configs.append({"name": name, "trial": None, "params": params,
                        "queue": dict(effective_queue(cfg.queue, params).__dict__)})
    return {"study": study_name, "storage": storage, "configs": configs}


def _optuna_storage(url: str) -> Any:
    from tuning.study import open_storage

    return open_storage(url, create=False)


def claims_url_for(storage: str | None, out: Path) -> str:
    """An SQL URL from ``--storage`` when it is one; else a SQLite file in the output directory."""
    if storage and storage.split("://", 1)[0].split("+")[0] in ("sqlite", "postgresql", "mysql"):
        return storage
    return f"sqlite:///{(out / 'validation.db').resolve()}"


def job_namespace(args: ValidateArgs, base: DflashConfig) -> str:
    ident = {"configs": [(c["name"], c["queue"]) for c in args.selection["configs"]], "takes": args.takes,
             "base": base.to_dict(), "calibration": args.calibration}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- training seeds (held-out quality)
SEED_MARK = "@seed"  # a seed replicate's name: "<config>@seed<N>"


def with_seeds(selection: dict[str, Any], seeds: int, base_seed: int) -> dict[str, Any]:
    """The selection with ``seeds - 1`` more training runs of each configuration (seeds ``base_seed + 1``
    ...), for the held-out quality comparison: a quality claim needs the variance between runs
    (:mod:`tuning.validation.paired`). A replicate is its own job (``<config>@seed<N>``) whose held-out
    set stays the base seed's (``[train] quality_seed``); its blocks feed the held-out comparison only,
    never the block objectives (those pair configurations by the shared data order of one seed)."""
    if seeds <= 1:
        return selection
    base = [c for c in selection["configs"] if not c.get("replicate_of")]
    extra = [{**c, "name": f"{c['name']}{SEED_MARK}{base_seed + r}", "seed": base_seed + r,
              "replicate_of": c["name"]} for r in range(1, seeds) for c in base]
    return {**selection, "configs": [*base, *extra], "seeds": seeds}


def seed_runs(configs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """config -> the names of its runs, one per training seed (the config's own run first)."""
    out: dict[str, list[str]] = {c["name"]: [c["name"]] for c in configs if not c.get("replicate_of")}
    for c in configs:
        if c.get("replicate_of") in out:
            out[c["replicate_of"]].append(c["name"])
    return out


# --------------------------------------------------------------------------- blocks and rounds
def queue_overrides(queue: dict[str, Any]) -> dict[str, Any]:
    return {f"queue.{k}": v for k, v in queue.items() if v is not None}


def max_looks(takes: int, block_takes: int) -> int:
    """Rounds (looks at the evidence), fixed before the first block: ceil(takes / block_takes)."""
    return math.ceil(takes / block_takes)


def unit_name(config: str, block: int) -> str:
    return f"{config}#{block}"


def split_unit(unit: str) -> tuple[str, int]:
    name, _, k = unit.rpartition("#")
    return name, int(k)


def unit_order(names: list[str], looks: int) -> list[str]:
    """Round-major: every configuration's block k before any block k+1 (ABCABC...)."""
    return [unit_name(n, k) for k in range(looks) for n in names]


def unit_ready(unit: str, statuses: dict[str, str]) -> bool:
    """Block k of a config waits for round k-1 to be over and for its own block k-1 to have worked
    (it continues from that block's checkpoint)."""
    name, k = split_unit(unit)
    if k == 0:
        return True
    prev = [s for u, s in statuses.items() if split_unit(u)[1] == k - 1]
    return statuses.get(unit_name(name, k - 1)) == "done" and all(s in ("done", "failed", "skipped") for s in prev)


def block_rule(cfg: DflashConfig, takes: int, requested: int | None = None) -> tuple[int, str]:
    """(takes per block, the reason): the default block is the smallest whole number of the data
    order's phases that holds one window of the configured ``[metrics] window`` W.

    Why: a block is the unit of replication, so consecutive blocks must be alike. The
    ``length_grouped`` order cuts the epoch into mega-batches of ``mega_batch`` items, each sorted
    longest first: inside one the lengths sweep from long to short (a sawtooth), so a block shorter
    than a mega-batch sees a different part of the sweep each time and swings with it. A block of
    whole mega-batches sees whole sweeps. It must also hold a window, since the window defines
    ``mix_efficiency`` (a block is measured with W whatever its length). ``random`` has no phase
    longer than an item and ``sorted`` one as long as the epoch (no block can hold it): there the
    window is the phase. ``requested`` (``--block-takes``) is used as given, the rule's figure said."""
    w, per_take = cfg.metrics.window, cfg.queue.items_per_take
    order, mega = cfg.workload.order, cfg.workload.mega_batch
    phase = mega if order == "length_grouped" else w
    items = phase * math.ceil(w / phase)
    rule = math.ceil(items / per_take)
    why = (f"{items // phase} mega-batch(es) of {mega} items (the length_grouped order's phase) holding at least "
           f"one window of W = {w} items" if order == "length_grouped" else
           f"one window of W = {w} items (the {order} order has no phase a block can hold)")
    if per_take > 1:
        why += f", at {per_take} items per take"
    if requested is not None:
        return requested, f"given (--block-takes {requested}); the rule would give {rule} takes: {why}"
    if rule > takes:
        return takes, (f"the whole budget of {takes} takes: shorter than the rule's {rule} takes ({why}), so every "
                       f"block is the one block and its transient is in the prediction as in the measurement")
    return rule, f"{rule} takes: {why}"


def block_steps(cfg: DflashConfig, args: ValidateArgs, block: int) -> tuple[int, int]:
    """(steps at the end of this block, steps of the whole budget): takes are per configuration."""
    per_step = cfg.cluster.n_drafter
    total = max(1, math.ceil(args.takes / per_step))
    return min(total, (block + 1) * max(1, math.ceil(args.block_takes / per_step))), total
