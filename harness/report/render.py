"""Sections (sections.py) -> Markdown (figures as SVG files) and one self-contained HTML file (figures
inline): the only place either format is written, for the sweep and the compare report alike.

The HTML carries a window.onerror hook that writes any script error into #js-errors, so a
headless browser's dumped DOM shows whether the page produced console errors.
"""

from __future__ import annotations

import base64
import html
import os
import re

from harness.report import plots
from harness.report.sections import Code, Figure, Items, Section, Table

CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f1f3f5}caption{caption-side:top;text-align:left;
font-weight:600;padding:4px 0}img{max-width:100%;display:block;margin:.5em 0}section{margin-bottom:2em}
nav a{margin-right:1em}.quoted{color:#8a4b00}.wide{overflow-x:auto;max-width:100%}"""

ERROR_HOOK = """<script>window.__errors=[];window.onerror=function(m){window.__errors.push(String(m));
var d=document.getElementById('js-errors');if(d){d.setAttribute('data-errors',window.__errors.length);
d.textContent=window.__errors.join('\\n');}};</script>"""


def _md_cell(v: str) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _md_block(b, img_dir: str) -> list[str]:
    if isinstance(b, Figure):
        return [f"![{b.alt}]({img_dir}/{b.name}.{plots.FORMAT})", ""]
    if isinstance(b, Table):
        out = [f"*{_md_cell(b.caption)}*", ""] if b.caption else []
        out.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
        out.append("|" + "---|" * len(b.headers))
        return out + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows] + [""]
    if isinstance(b, Items):
        return [f"- {item}" for item in b.items] + [""] if b.items else []
    if isinstance(b, Code):
        return ["```", b.text, "```", ""]
    return [b, ""]


def markdown(title: str, sections: list[Section], img_dir: str, *, contents: bool = True) -> str:
    """`contents`: a line of links to the sections, and an anchor before each heading."""
    titled = [s for s in sections if s.title]
    out = [f"# {title}", ""]
    if contents:
        out += ["Sections: " + ", ".join(f"[{s.title}](#{s.id})" for s in titled), ""]
    for s in sections:
        if s.title:
            out += ([f'<a id="{s.id}"></a>'] if contents else []) + [f"## {s.title}", ""]
        for b in s.blocks():
            out += _md_block(b, img_dir)
    return "\n".join(out)


def _inline(text: str) -> str:
    """A paragraph's Markdown `**bold**`, `` `code` `` and `[text](link)` as HTML, the rest escaped."""
    text = html.escape(text)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r"<a href='\2'>\1</a>", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _html_table(t) -> str:
    cap = f"<caption>{html.escape(t.caption)}</caption>" if t.caption else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in t.rows)
    # a wide table scrolls inside its own box instead of running off the page
    return f"<div class='wide'><table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def img_tag(name: str, image: bytes, alt: str) -> str:
    """A figure inline in a single-file HTML page (the SVG as a data URI: the page's own ids and
    styles cannot clash with the figure's)."""
    data = base64.b64encode(image).decode()
    return f"<img id='img-{html.escape(name)}' alt='{html.escape(alt)}' src='data:{plots.MIME};base64,{data}'>"


def _html_block(b) -> str:
    if isinstance(b, Figure):
        return img_tag(b.name, b.image, b.alt)
    if isinstance(b, Table):
        return _html_table(b)
    if isinstance(b, Items):
        return "<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in b.items) + "</ul>" if b.items else ""
    if isinstance(b, Code):
        return f"<pre>{html.escape(b.text)}</pre>"
    return f"<p>{_inline(b)}</p>"


def html_page(title: str, sections: list[Section]) -> str:
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        ERROR_HOOK,
        f"<style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><div id='js-errors' data-errors='0'></div><nav>",
        "".join(f"<a href='#{s.id}'>{html.escape(s.title)}</a>" for s in sections if s.title),
        "</nav>",
    ]
    for s in sections:
        parts.append(f"<section id='{s.id}'>" + (f"<h2>{html.escape(s.title)}</h2>" if s.title else ""))
        parts += [_html_block(b) for b in s.blocks()]
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def save_figures(img_dir: str, sections: list[Section], files=None) -> None:
    """Each figure as an SVG file in img_dir, where the Markdown links it. With `files` (a
    harness.files.atomic.Together) they go in with the pages; alone, together among themselves."""
    from harness.files.atomic import Together

    if files is None:
        with Together("--out") as files:
            save_figures(img_dir, sections, files)
        remove_stale(img_dir, sections)
        return
    os.makedirs(img_dir, exist_ok=True)
    for s in sections:
        for fig in s.figures():
            files.write(os.path.join(img_dir, f"{fig.name}.{plots.FORMAT}"), fig.image)


def remove_stale(img_dir: str, sections: list[Section]) -> None:
    for s in sections:
        for fig in s.figures():
            stale = os.path.join(img_dir, f"{fig.name}.png")  # the same figure as an earlier version drew it
            if os.path.exists(stale):
                os.remove(stale)


def write(out_dir: str, title: str, sections: list[Section]) -> dict[str, str]:
    """Write report.md (+ img/*.svg) and report.html into out_dir; returns their paths. They are
    written whole or not at all (harness.files.atomic): a full disk leaves the earlier report as it was."""
    from harness.files.atomic import Together

    md, page = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.html")
    with Together("--out") as files:
        os.makedirs(os.path.join(out_dir, "img"), exist_ok=True)  # out_dir too, where it is still missing
        files.write(md, markdown(title, sections, "img"))
        files.write(page, html_page(title, sections))
        save_figures(os.path.join(out_dir, "img"), sections, files)
    remove_stale(os.path.join(out_dir, "img"), sections)
    return {"markdown": md, "html": page}
