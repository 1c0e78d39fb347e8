"""The report as data (sections of blocks) and its two renderings: self-contained HTML and Markdown.

Both renderings walk the same blocks, so the Markdown twin says exactly what the HTML says. The HTML
needs nothing outside the file: inline CSS, figures as base64 ``data:`` URIs, no scripts, no
external URL (even the favicon is an empty data URI, so a browser makes no request at all).
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import pandas as pd

from reports.fmt import md_table


@dataclass(frozen=True)
class Text:
    text: str
    strong: bool = False


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Table:
    df: pd.DataFrame
    caption: str = ""


@dataclass(frozen=True)
class Figure:
    name: str  # file stem under figures/
    png: bytes
    caption: str


@dataclass(frozen=True)
class Missing:
    """A section (or part) whose inputs were not given: says what would fill it."""

    text: str


Block = Text | Bullets | Code | Table | Figure | Missing


@dataclass
class Section:
    title: str
    anchor: str
    blocks: list[Block] = field(default_factory=list)


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1180px;margin:1.5em auto;
padding:0 1em;color:#1b1f23;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.88em}
th,td{border:1px solid #d0d7de;padding:.25em .55em;text-align:right;vertical-align:top}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}
caption{caption-side:bottom;text-align:left;font-size:.85em;color:#57606a;padding-top:.3em}
pre{background:#f6f8fa;padding:.7em;border-radius:4px;white-space:pre-wrap;overflow-wrap:anywhere}
.wide{overflow-x:auto;max-width:100%}figure{margin:1em 0}img{max-width:100%;height:auto;border:1px solid #eaeef2}
figcaption{font-size:.85em;color:#57606a}.missing{color:#8c6d00;background:#fff8c5;padding:.4em .6em}
.strong{font-weight:600;font-size:1.05em}nav ol{columns:2;font-size:.9em}
"""


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def render_html(title: str, sections: list[Section]) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           '<link rel="icon" href="data:,">', f"<title>{_esc(title)}</title>", f"<style>{CSS}</style>",
           "</head><body>", f"<h1>{_esc(title)}</h1>"]
    toc = "".join(f'<li><a href="#{s.anchor}">{_esc(s.title)}</a></li>' for s in sections)
    out.append(f"<nav><ol>{toc}</ol></nav>")
    for s in sections:
        out.append(f'<section id="{s.anchor}"><h2>{_esc(s.title)}</h2>')
        out += [_html_block(b) for b in s.blocks]
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_block(b: Block) -> str:
    if isinstance(b, Text):
        return f'<p class="strong">{_esc(b.text)}</p>' if b.strong else f"<p>{_esc(b.text)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_esc(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Code):
        return f"<pre><code>{_esc(b.text)}</code></pre>"
    if isinstance(b, Missing):
        return f'<p class="missing">Not available: {_esc(b.text)}</p>'
    if isinstance(b, Table):
        table = b.df.to_html(index=False, escape=True, border=0, na_rep="n/a")
        if b.caption:
            table = table.replace(">\n", f">\n<caption>{_esc(b.caption)}</caption>\n", 1)
        return f'<div class="wide">{table}</div>'  # a wide table scrolls in its box, the page does not
    data = base64.b64encode(b.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(b.caption)}">'
            f"<figcaption>{_esc(b.caption)}</figcaption></figure>")


def render_markdown(title: str, sections: list[Section]) -> str:
    out = [f"# {title}", ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        for b in s.blocks:
            out += [_md_block(b), ""]
    return "\n".join(out)


def _md_block(b: Block) -> str:
    if isinstance(b, Text):
        return f"**{b.text}**" if b.strong else b.text
    if isinstance(b, Bullets):
        return "\n".join(f"- {i}" for i in b.items)
    if isinstance(b, Code):
        return f"```\n{b.text}\n```"
    if isinstance(b, Missing):
        return f"> Not available: {b.text}"
    if isinstance(b, Table):
        return md_table(b.df) + (f"\n\n*{b.caption}*" if b.caption else "")
    return f"![{b.caption}](figures/{b.name}.png)\n\n*{b.caption}*"


def figures(sections: list[Section]) -> list[Figure]:
    return [b for s in sections for b in s.blocks if isinstance(b, Figure)]
