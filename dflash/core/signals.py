"""How a ``dflash`` process stops when it is told to: SIGTERM takes the path Ctrl-C takes.

Clusters and supervisors (Slurm at a time limit or ``scancel``, Kubernetes, systemd) stop a job with
SIGTERM and, after a grace period, SIGKILL. Every long verb already has a clean Ctrl-C path (the
one line, a sidecar marked interrupted, workers stopped, a consistent journal, claims given back);
this module makes SIGTERM take that same path instead of a second one: its handler raises
:class:`Terminated`, a :class:`KeyboardInterrupt`, in the main thread, so every ``except
KeyboardInterrupt`` and ``finally`` on the way out runs unchanged, and only the outermost catcher
(the CLI) tells them apart (``dflash VERB: terminated``, exit 143, against ``interrupted`` and 130).

Rules this module holds, and never does more than:
- SIGTERM is never ignored. A second SIGTERM raises again where the cleanup is, like a second
  Ctrl-C: it ends the process at once; writes are atomic or whole-record, so nothing is half-written.
- An inherited *ignored* SIGINT (a POSIX background job) stays ignored: Python then installs no
  KeyboardInterrupt handler, and nothing here installs one.
- Torch-free and thread-aware: handlers can only be set in the main thread; elsewhere nothing is set.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: the shell's status for a job ended by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: the shell's status for a job ended by SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as the exception Ctrl-C raises, so that its clean-up paths run."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def install() -> None:
    """SIGTERM raises :class:`Terminated` in this process's main thread from now on."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


class DeferredStop:
    """SIGTERM for a process whose main thread spends time in code an exception must not cut in two.

    A storage client's lock (Optuna's journal file lock renames, then unlinks; an exception between
    the two made it fail with FileNotFoundError) is not safe against an exception raised at any
    bytecode. Here the signal is only noted, and :class:`Terminated` is raised inside
    :meth:`interruptible` sections (pure computation, such as a simulation) or at :meth:`check` points
    the caller places between storage calls. Installed in place of :func:`install`, in the main thread.
    """

    def __init__(self) -> None:
        self.pending = False
        self._depth = 0

    def install(self) -> DeferredStop:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.pending = True
        if self._depth:
            raise Terminated()

    def check(self) -> None:
        """Raise :class:`Terminated` here if SIGTERM came while it could not be raised."""
        if self.pending:
            raise Terminated()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A section SIGTERM may cut at any point (raising at its entry if one came before)."""
        self.check()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


def sigint_ignored() -> bool:
    """True when SIGINT was ignored by whoever started us (a background job of a non-interactive shell)."""
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


@contextlib.contextmanager
def kept_handlers(*signums: int) -> Iterator[None]:
    """Whatever the body installs for ``signums`` (torch's elastic launcher installs its own for SIGTERM
    and SIGINT and never restores them) is undone when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in signums}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Within the body SIGTERM raises :class:`Terminated`; the caller's handler is back afterwards
    (``dflash.cli.main`` is also called in-process, by tests and scripts)."""
    with kept_handlers(signal.SIGTERM):
        install()
        yield


def exit_status(exc: KeyboardInterrupt) -> int:
    """143 for a SIGTERM, 130 for Ctrl-C."""
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def stop_word(exc: KeyboardInterrupt) -> str:
    """The word of the CLI's one line: ``terminated`` (SIGTERM) or ``interrupted`` (Ctrl-C)."""
    return "terminated" if isinstance(exc, Terminated) else "interrupted"


def interrupt_for(stopped_by: str) -> KeyboardInterrupt | None:
    """The exception a library caller gets for a child job that stopped on a signal: the rank job's
    summary says ``stopped_by = "signal SIGTERM"`` (or SIGINT) and the caller must stop as well."""
    if stopped_by == "signal SIGTERM":
        return Terminated()
    if stopped_by.startswith("signal "):
        return KeyboardInterrupt()
    return None
