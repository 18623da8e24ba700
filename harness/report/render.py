"""Sections -> Markdown (figures as SVG files) and one self-contained HTML file (figures inline).

The HTML carries a window.onerror hook that writes any script error into #js-errors, so a
headless browser's dumped DOM shows whether the page produced console errors.
"""

from __future__ import annotations

import base64
import html
import os

from harness.report import plots
from harness.report.analysis import Section

CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f1f3f5}caption{caption-side:top;text-align:left;
font-weight:600;padding:4px 0}img{max-width:100%;display:block;margin:.5em 0}section{margin-bottom:2em}
nav a{margin-right:1em}.quoted{color:#8a4b00}"""

ERROR_HOOK = """<script>window.__errors=[];window.onerror=function(m){window.__errors.push(String(m));
var d=document.getElementById('js-errors');if(d){d.setAttribute('data-errors',window.__errors.length);
d.textContent=window.__errors.join('\\n');}};</script>"""


def _md_cell(v: str) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(title: str, sections: list[Section], img_dir: str) -> str:
    out = [f"# {title}", ""]
    out += ["Sections: " + ", ".join(f"[{s.title}](#{s.id})" for s in sections), ""]
    for s in sections:
        out += [f'<a id="{s.id}"></a>', f"## {s.title}", ""]
        for t in s.text:
            out += [t, ""]
        for name, _, alt in s.images:
            out += [f"![{alt}]({img_dir}/{name}.{plots.FORMAT})", ""]
        for t in s.tables:
            if t.caption:
                out += [f"*{_md_cell(t.caption)}*", ""]
            out.append("| " + " | ".join(_md_cell(h) for h in t.headers) + " |")
            out.append("|" + "---|" * len(t.headers))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
            out.append("")
    return "\n".join(out)


def _html_table(t) -> str:
    cap = f"<caption>{html.escape(t.caption)}</caption>" if t.caption else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in t.rows)
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def img_tag(name: str, image: bytes, alt: str) -> str:
    """A figure inline in a single-file HTML page (the SVG as a data URI: the page's own ids and
    styles cannot clash with the figure's)."""
    data = base64.b64encode(image).decode()
    return f"<img id='img-{html.escape(name)}' alt='{html.escape(alt)}' src='data:{plots.MIME};base64,{data}'>"


def html_page(title: str, sections: list[Section]) -> str:
    parts = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
             f"<title>{html.escape(title)}</title>", ERROR_HOOK, f"<style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><div id='js-errors' data-errors='0'></div><nav>",
             "".join(f"<a href='#{s.id}'>{html.escape(s.title)}</a>" for s in sections), "</nav>"]
    for s in sections:
        parts.append(f"<section id='{s.id}'><h2>{html.escape(s.title)}</h2>")
        parts += [f"<p>{html.escape(t)}</p>" for t in s.text]
        for name, image, alt in s.images:
            parts.append(img_tag(name, image, alt))
        parts += [_html_table(t) for t in s.tables]
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(out_dir: str, title: str, sections: list[Section]) -> dict[str, str]:
    """Write report.md (+ img/*.svg) and report.html into out_dir; returns their paths."""
    img_dir = os.path.join(out_dir, "img")
    os.makedirs(img_dir, exist_ok=True)
    for s in sections:
        for name, image, _ in s.images:
            with open(os.path.join(img_dir, f"{name}.{plots.FORMAT}"), "wb") as f:
                f.write(image)
            stale = os.path.join(img_dir, f"{name}.png")  # the same figure as an earlier version drew it
            if os.path.exists(stale):
                os.remove(stale)
    md, page = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.html")
    with open(md, "w") as f:
        f.write(markdown(title, sections, "img"))
    with open(page, "w") as f:
        f.write(html_page(title, sections))
    return {"markdown": md, "html": page}
