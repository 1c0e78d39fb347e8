"""Errors that reach the user as one line and exit status 2.

Every layer raises :class:`ConfigError` for bad input; only the CLI turns it into text. Keeping the
key and the allowed range as separate fields lets the CLI name the flag *and* the file key.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value: names the key, what is allowed and what was given."""

    def __init__(self, key: str, allowed: str, got: object = None, *, show_got: bool = True) -> None:
        self.key = key
        self.allowed = allowed
        self.got = got
        self.show_got = show_got
        super().__init__(self.line())

    def line(self) -> str:
        got = f" (got {self.got!r})" if self.show_got else ""
        return f"{self.key}: {self.allowed}{got}"


class JointConfigError(ConfigError):
    """A bad input every rank finds at once, from a collective's verdict (a run directory one node cannot
    see): each rank says its own line, and the ranks leave together, so that no launcher's teardown of the
    first rank to exit cuts a peer's line off (dflash.pipeline.rank)."""

