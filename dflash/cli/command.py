"""Parsing, validation and the entry point of the ``dflash`` command.

Every invocation goes the same way (:func:`validate`): argparse reads the words (converters only
parse), the verb's pure flags (those that are not config keys: paths, counts) are checked, the
verb's own cross-flag check runs, the config file is loaded and the key flags applied on top of it
with one :func:`dflash.core.config.with_overrides` call, and only then does the verb's handler run
with the validated, frozen config. Any bad input on that path is one line on stderr,

    dflash <verb>: error: <key> (<flag>): <allowed> (got <value>)

(``<key>: ...`` for a key no flag of the verb sets, ``<flag>: ...`` for a pure flag) and exit
status 2, before anything is written. A handler may raise :class:`~dflash.core.errors.ConfigError`
for inputs it validates itself; it is reported the same way, and any output path of the verb's
``outfile``/``outdir`` flags that did not exist before the handler ran is removed again
(:func:`removed_on_bad_input`), so a refused start leaves nothing behind. Each output path is
tried (a file created and removed where it will go, :func:`try_outputs`) before the handler runs:
permission bits alone pass ``/proc`` and read-only mounts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dflash import __version__
from dflash.cli import verbs
from dflash.cli.options import Opt, Verb, check_pure, config_value, default_base_config
from dflash.core.config import DflashConfig, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.signals import exit_status, stop_word, terminate_raises

PROG = "dflash"

Handler = Callable[[argparse.Namespace, DflashConfig], int]

_MODULES = verbs.load()
VERBS: dict[str, Verb] = {name: m.VERB for name, m in _MODULES.items()}
HANDLERS: dict[str, Handler] = {name: m.handle for name, m in _MODULES.items()}


class UsageError(Exception):
    """argparse's own complaint (unknown option, missing value), reported as one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message.removeprefix("argument "))


def _lenient(kind: type) -> Callable[[str], Any]:
    """Parse an int/float when the text is one, else keep the text for validation to reject."""

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            return text

    convert.__name__ = kind.__name__
    return convert


def _add(parser: argparse.ArgumentParser, opt: Opt) -> None:
    kw: dict[str, Any] = {"help": opt.help + (" (required)" if opt.required else "")}
    if opt.kind == "switch":
        kw["action"] = "store_true"
    else:
        kw["type"] = {"int": _lenient(int), "float": _lenient(float)}.get(opt.kind, str)
        kw["default"] = opt.default
        if opt.metavar:
            kw["metavar"] = opt.metavar
    if opt.positional:
        kw["nargs"] = "*" if opt.repeat else "?"
        parser.add_argument(opt.dest, metavar=opt.flag, **kw)
    else:
        if opt.repeat:
            kw["action"] = "append"
        parser.add_argument(opt.flag, dest=opt.dest, **kw)


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog=PROG, allow_abbrev=False,
                   description="Simulate, sweep, train, validate and report the hidden-state queue "
                               "of a decoupled DFlash drafter-training pipeline.")
    root.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = root.add_subparsers(dest="verb", metavar="VERB")
    for name, verb in VERBS.items():
        p = sub.add_parser(name, help=verb.help, description=verb.help, allow_abbrev=False,
                           prog=f"{PROG} {name}")
        p.add_argument("--config", metavar="FILE", help="TOML configuration file (flags override it)")
        for opt in verb.all_opts():
            _add(p, opt)
    return root


def validate(verb_name: str, args: argparse.Namespace) -> DflashConfig:
    """Config file + flags -> the full, frozen config; pure flags checked. Raises ConfigError."""
    verb = VERBS[verb_name]
    overrides: dict[str, Any] = {}
    for opt in verb.all_opts():
        value = getattr(args, opt.dest)
        if value is None or value == []:
            if opt.required:
                raise ConfigError(opt.flag, f"required: {opt.help}", show_got=False)
            continue
        if opt.key is not None:
            overrides[opt.key] = config_value(opt, value)
        else:
            for v in value if opt.repeat else (value,):
                check_pure(opt, v)
    if verb.check is not None:
        verb.check(args, overrides)
    base = verb.base_config(args, overrides) if verb.base_config is not None else \
        default_base_config(args, overrides, verb.cpu_profile)
    return with_overrides(base, overrides)


def error_line(prog: str, exc: ConfigError, flag_for_key: dict[str, str]) -> str:
    """``<prog>: error: <key> (<flag>): <allowed> (got <value>)`` on one line."""
    flag = flag_for_key.get(exc.key)
    head = f"{exc.key} ({flag})" if flag and flag != exc.key else exc.key
    got = f" (got {exc.got!r})" if exc.show_got else ""
    return one_line(f"{prog}: error: {head}: {exc.allowed}{got}")


def new_outputs(verb: Verb, args: argparse.Namespace) -> list[Path]:
    """The outermost missing path of each output flag (what a handler's ``mkdir(parents=True)``
    or first write would create), before the handler runs."""
    paths = []
    for opt in verb.all_opts():
        value = getattr(args, opt.dest, None)
        if opt.kind not in ("outfile", "outdir") or not value:
            continue
        for v in value if opt.repeat else (value,):
            p = Path(v).absolute()
            if p.exists():
                continue
            while not p.parent.exists():
                p = p.parent
            paths.append(p)
    return paths


def try_outputs(verb: Verb, args: argparse.Namespace) -> None:
    """Every output flag's path can really be written: tried, not predicted (raises ConfigError).

    :func:`~dflash.cli.options.check_out_path` reads permission bits (``os.access``), which say yes
    to root everywhere and say nothing of read-only mounts or pseudo file systems (``/proc``): such a
    path used to pass, the work ran, and the first write was a traceback. Here a file is created and
    removed where the output will go (an existing output file is opened for appending, unchanged),
    before the handler runs, so nothing is left behind either way.
    """
    for opt in verb.all_opts():
        value = getattr(args, opt.dest, None)
        if opt.kind not in ("outfile", "outdir") or not value:
            continue
        for v in value if opt.repeat else (value,):
            _try_writing(opt.flag, Path(v).absolute(), v)


def _try_writing(flag: str, p: Path, given: str) -> None:
    try:
        if p.is_file():
            with p.open("ab"):
                return
        where = p if p.is_dir() else p.parent
        while not where.exists():
            where = where.parent
        fd, probe = tempfile.mkstemp(prefix=".dflash-write-test-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(flag, f"cannot be written here ({exc.strerror or exc})", given) from None


@contextlib.contextmanager
def removed_on_bad_input(paths: list[Path]) -> Iterator[None]:
    """A handler that refuses its input (ConfigError) leaves no output behind that it created."""
    try:
        yield
    except ConfigError:
        for p in paths:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()
        raise


def one_line(text: str) -> str:
    return " ".join(text.split())


def _prog_from_argv(argv: Sequence[str]) -> str:
    verb = next((a for a in argv if a in VERBS), None)
    return f"{PROG} {verb}" if verb else PROG


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dflash`` command; returns the exit status (0 ok, 2 bad input, 130 Ctrl-C, 143 SIGTERM).

    SIGTERM (a cluster's stop: Slurm, Kubernetes, systemd) raises :class:`~dflash.core.signals.Terminated`,
    a KeyboardInterrupt, so every verb stops on it exactly as it does on Ctrl-C; only the line and the
    status differ (``dflash VERB: terminated``, 143)."""
    with terminate_raises():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    prog, verb_name = PROG, None
    try:
        try:
            args, extras = build_parser().parse_known_args(argv)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else 0
        verb_name = args.verb
        if verb_name is None:
            raise UsageError(PROG, f"VERB: required, one of {', '.join(VERBS)} (see dflash --help)")
        prog = f"{PROG} {verb_name}"
        if extras:
            raise UsageError(prog, f"unrecognized arguments: {' '.join(extras)}")
        cfg = validate(verb_name, args)
        try_outputs(VERBS[verb_name], args)
        if VERBS[verb_name].pins_data:
            from dflash.data.dataset_choice import pin_dataset

            cfg = pin_dataset(cfg)
        with removed_on_bad_input(new_outputs(VERBS[verb_name], args)):
            return HANDLERS[verb_name](args, cfg)
    except UsageError as exc:
        where = exc.prog if exc.prog != PROG else _prog_from_argv(argv)
        print(one_line(f"{where}: error: {exc}"), file=sys.stderr)
    except ConfigError as exc:
        keys = VERBS[verb_name].flag_for_key() if verb_name else {}
        print(error_line(prog, exc, keys), file=sys.stderr)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated): the verb has cleaned up on the way out
        print(f"{prog}: {stop_word(exc)}", file=sys.stderr)
        return exit_status(exc)
    return 2
