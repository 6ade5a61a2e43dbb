"""A report as blocks, and the blocks as Markdown and as one HTML file.

What a report shows comes partly from records someone else may have written (run and group
names, labels built from config values, error messages): a heading, a list item and a table
cell therefore take their text through `md_text` (one line, Markdown's and HTML's active
characters escaped), and a path shown as code through `md_code`, so a name can neither start
a new line (a heading, a fenced block, a line an `authorized_keys` reader takes) nor open a
link, an image or an HTML tag. A paragraph is the report's own prose, written as Markdown;
the text it quotes from records goes through the same two functions where it is built.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass

from stalepipe.fileio import one_line


@dataclass
class Block:
    """One piece of a report: kind is 'h' (heading), 'p' (paragraph), 'ul' (list),
    'table' (header + rows) or 'img' (PNG bytes + file name)."""

    kind: str
    text: str = ""
    items: list[str] | None = None
    header: list[str] | None = None
    rows: list[list[str]] | None = None
    png: bytes | None = None


# Backslash-escaped in text from records: the escape itself, code spans, emphasis, links and
# images, HTML tags and entities, table cells (CommonMark escapes any ASCII punctuation). A '>'
# only quotes at the start of a line, where `md_text` never puts text from a record.
_ACTIVE = re.compile(r"([\\`*\[\]<|&])")


def md_text(text: object) -> str:
    """`text` as inert Markdown on one line (`fileio.one_line`, then `_ACTIVE` escaped; a
    leading '#' too, so it cannot become a heading)."""
    escaped = _ACTIVE.sub(r"\\\1", one_line(text))
    return "\\" + escaped if escaped.startswith("#") else escaped


def md_code(text: object) -> str:
    """`text` as an inline code span on one line, fenced by more backticks than it holds."""
    line = one_line(text)
    fence = "`" * (1 + max((len(run) for run in re.findall(r"`+", line)), default=0))
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"


def md_fenced(text: str) -> str:
    """`text` as a Markdown code block whose fence is longer than any run of backticks in it
    (a label from a record cannot close it), every line printable (`fileio.one_line`)."""
    lines = [one_line(line) for line in text.splitlines()]
    fence = "`" * max([3, *(len(run) + 1 for line in lines for run in re.findall("`+", line))])
    return "\n".join([fence, *lines, fence])


def to_markdown(blocks: list[Block]) -> str:
    """The report as Markdown: headings, list items and table cells escaped (`md_text`)."""
    out, level = [], 1
    for b in blocks:
        if b.kind == "h":
            out.append(("#" * level) + " " + md_text(b.text) + "\n")
            level = 2
        elif b.kind == "p":
            out.append(b.text + "\n")
        elif b.kind == "ul":
            out.append("\n".join(f"- {md_text(i)}" for i in b.items or []) + "\n")
        elif b.kind == "table":
            out.append(md_table(b.header or [], b.rows or []))
        elif b.kind == "img":
            out.append(f"![{md_text(b.text)}]({b.text})\n")
    return "\n".join(out)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, every cell through `md_text`."""
    lines = [
        "| " + " | ".join(md_text(h) for h in header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(md_text(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_html(blocks: list[Block]) -> str:
    """The report as one HTML file (plots embedded as base64 PNG), all text escaped."""
    parts, level = [], 1
    title = next((b.text for b in blocks if b.kind == "h"), "report")
    esc = lambda s: html.escape(one_line(s))  # noqa: E731
    for b in blocks:
        if b.kind == "h":
            parts.append(f"<h{level}>{esc(b.text)}</h{level}>")
            level = 2
        elif b.kind == "p":
            parts.append(f"<p>{html.escape(b.text)}</p>")
        elif b.kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in b.items or []) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in b.header or [])
            body = "".join(
                "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in b.rows or []
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif b.kind == "img" and b.png:
            data = base64.b64encode(b.png).decode("ascii")
            parts.append(f'<img alt="{esc(b.text)}" src="data:image/png;base64,{data}">')
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px}"
        "th{background:#f3f3f3}img{max-width:100%}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )
