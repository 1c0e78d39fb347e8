"""The option table: what each verb accepts and how a value is judged.

A verb module (``dflash/cli/verbs/<verb>.py``) declares its :class:`Verb` with these :class:`Opt`
rows; :mod:`dflash.cli.command` builds argparse from them and validates. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import (
    FLAG_FOR_KEY,
    GATES,
    POLICIES,
    QUEUE_MODES,
    DflashConfig,
    check_choice,
    check_float,
    check_int,
)
from dflash.core.errors import ConfigError

WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class Opt:
    """One option of a verb, and how it is validated.

    ``key`` set: the value overrides that config key and the config's validation judges it (the
    error names the key and this flag). ``key`` None: a pure flag, checked here by ``kind``.
    Kinds: ``int``/``float`` (pure: ``>= lo`` resp. ``> lo``), ``str`` (non-empty),
    ``choice``, ``devices`` (comma-separated list), ``switch`` (store_true; with a key it sets
    ``value``), ``infile``/``indir``/``inpath`` (must exist), ``outfile``/``outdir`` (writable
    before any work: :func:`check_out_path`; a path this invocation creates is removed again if
    the verb then fails on bad input, see :mod:`dflash.cli.command`).
    """

    flag: str  # "--n-target", or a positional's name ("RUN_DIR")
    kind: str
    help: str
    key: str | None = None
    lo: float | None = None
    choices: tuple[str, ...] = ()
    default: Any = None
    required: bool = False
    repeat: bool = False
    value: Any = None
    metavar: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_").lower()


# check(args, overrides): raise ConfigError for combinations one flag's check cannot see.
Check = Callable[[argparse.Namespace, dict[str, Any]], None]
# base_config(args, overrides): the config the flags apply to, where it is not the --config file.
BaseConfig = Callable[[argparse.Namespace, dict[str, Any]], DflashConfig]


@dataclass(frozen=True)
class Verb:
    help: str
    opts: tuple[Opt, ...] = ()
    queue_flags: bool = False
    cpu_profile: bool = False  # with no --config on a CPU machine, start from the packaged CPU profile
    check: Check | None = None
    base_config: BaseConfig | None = None
    # resolve workload.dataset ("auto") once before the handler and say which file, so every stage of
    # the verb (and every run it starts, via the config it writes) reads the same conversations
    pins_data: bool = False

    def all_opts(self) -> tuple[Opt, ...]:
        return (SEED, *(QUEUE_OPTS if self.queue_flags else ()), *self.opts)

    def flag_for_key(self) -> dict[str, str]:
        return {o.key: o.flag for o in self.all_opts() if o.key is not None}


SEED = Opt("--seed", "int", "random seed of the run (>= 0)", key="seed", metavar="N")
QUEUE_OPTS = (
    Opt(FLAG_FOR_KEY["queue.min_ready"], "int", "min-ready gate: items queued before a drafter takes "
        "(1 <= N <= max depth)", key="queue.min_ready", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.max_depth"], "int", "max-depth cap: producers block at this depth (>= 1)",
        key="queue.max_depth", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.max_bytes"], "int", "optional byte cap on queued items (>= 1)",
        key="queue.max_bytes", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.policy"], "str", "which bucket a drafter takes from next",
        key="queue.policy", metavar="{" + ",".join(POLICIES) + "}"),
    Opt(FLAG_FOR_KEY["queue.items_per_take"], "int", "items one take removes (>= 1)",
        key="queue.items_per_take", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.gate"], "str", "gate rule", key="queue.gate",
        metavar="{" + ",".join(GATES) + "}"),
    Opt(FLAG_FOR_KEY["queue.mode"], "str", "auto: the autopilot moves min-ready and max-depth between takes "
        "to hold --target-mix with the least queued memory; static: they stay as set",
        key="queue.mode", metavar="{" + ",".join(QUEUE_MODES) + "}"),
    Opt(FLAG_FOR_KEY["queue.target_mix_efficiency"], "float", "the rolling mix_efficiency the autopilot holds "
        "(0 < X <= 1.5, default 0.95)", key="queue.target_mix_efficiency", metavar="X"),
)
CALIBRATION = Opt("--calibration", "infile", "calibration file written by 'dflash calibrate'", metavar="FILE")
N_TARGET = Opt("--n-target", "int", "target workers (>= 1)", key="cluster.n_target", metavar="N")
N_DRAFTER = Opt("--n-drafter", "int", "drafter workers (>= 1)", key="cluster.n_drafter", metavar="N")


def on_this_node() -> str:
    """`` on node N (host H)`` for a rank of a job on several nodes (each node checks its own view of a path:
    a run directory on storage one node does not mount is missing there only); empty otherwise."""
    env = os.environ
    if "GROUP_RANK" not in env or env.get("LOCAL_WORLD_SIZE", "1") == env.get("WORLD_SIZE", "1"):
        return ""
    import socket

    return f" on node {env['GROUP_RANK']} (host {socket.gethostname()})"


def check_pure(opt: Opt, value: Any) -> None:
    """Validate one value of a flag that is not a config key."""
    flag, kind = opt.flag, opt.kind
    if kind == "int":
        check_int(flag, value, None if opt.lo is None else int(opt.lo))
    elif kind == "float":
        check_float(flag, value, opt.lo, lo_open=True)
    elif kind == "choice":
        check_choice(flag, value, opt.choices)
    elif kind == "str":
        if not value.strip():
            raise ConfigError(flag, "must not be empty", value)
    elif kind in ("infile", "indir", "inpath"):
        p = Path(value)
        ok = {"infile": p.is_file, "indir": p.is_dir, "inpath": p.exists}[kind]()
        what = {"infile": "an existing file", "indir": "an existing directory",
                "inpath": "an existing file or directory"}[kind]
        if not value or not ok:
            raise ConfigError(flag, f"must be {what}{on_this_node()}", value)
    elif kind in ("outfile", "outdir"):
        check_out_path(flag, value, kind)


def check_out_path(flag: str, value: str, kind: str, shown: str | None = None) -> None:
    """An output path can be written before any work is done; writes nothing.

    ``outfile``: not a directory; an existing file must be writable. ``outdir``: not an existing
    non-directory; an existing directory must be writable. A path that does not exist yet: its
    nearest existing ancestor must be a directory this user can write into (so a parent that is a
    file, or a read-only parent, is refused here and not after the work).
    """
    got = shown if shown is not None else value
    if not value:
        raise ConfigError(flag, "must not be empty", got)
    p = Path(value)
    if p.exists():
        if kind == "outfile" and p.is_dir():
            raise ConfigError(flag, "must be a file path (not a directory)", got)
        if kind == "outdir" and not p.is_dir():
            raise ConfigError(flag, "must be a directory path (not an existing file)", got)
        if not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise ConfigError(flag, "is not writable by this user", got)
        return
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(flag, f"cannot be created: {parent} is a file, not a directory", got)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"cannot be created: {parent} is not writable", got)


def check_storage_flag(url: str, flag: str = "--storage") -> None:
    """An Optuna storage URL is usable before any work: a file storage (journal path or
    ``sqlite:///PATH``) is a writable output path, and :func:`tuning.study.check_storage` accepts it
    (the right kind of file, or a PostgreSQL server that answers)."""
    from tuning.study import check_storage, storage_file

    path = storage_file(url)
    if path is not None and "://" not in url.removeprefix("sqlite:///"):
        check_out_path(flag, str(path), "outfile", shown=url)
    check_storage(url)


def config_value(opt: Opt, value: Any) -> Any:
    if opt.kind == "devices":
        return tuple(d.strip() for d in value.split(","))
    if opt.kind == "switch":
        return opt.value if value else None
    return value


def given_queue_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The queue flags given on the command line, as config keys -> values."""
    return {o.key: config_value(o, getattr(args, o.dest)) for o in QUEUE_OPTS
            if o.key is not None and getattr(args, o.dest) is not None}



PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def default_config_file(cpu_profile: bool, overrides: dict[str, Any]) -> Path | None:
    """With no --config on the CPU, the verbs that train start from the packaged CPU profile (the
    built-in defaults are the published GPU sizes: 5 draft layers, blocks of 16, 512 anchors, 2048 tokens)."""
    devices = (*overrides.get("target.devices", ("cpu",)), *overrides.get("drafter.devices", ("cpu",)))
    if cpu_profile and all(d == "cpu" for d in devices):
        return PROFILES / "cpu-smollm2.toml"
    return None


def default_base_config(args: argparse.Namespace, overrides: dict[str, Any], cpu_profile: bool) -> DflashConfig:
    """The config the flags apply to: --config FILE, else the CPU profile where the verb has one, else defaults."""
    from dflash.core.config import load_config

    return load_config(args.config or default_config_file(cpu_profile, overrides))
