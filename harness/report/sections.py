"""What a report says, apart from how it is written: sections of paragraphs, tables, figures,
lists and code blocks. render.py writes one list of them as Markdown and as HTML, so the two
formats of a report cannot drift apart. Paragraphs and list items may use Markdown's `**bold**`
and `` `code` `` (the HTML renders both)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass(frozen=True)
class Column:
    """A table's column: its header and how an item's cell is written, in one place."""

    header: str
    cell: Callable[[Any], str]


def table(columns: list[Column], items: list, caption: str = "") -> Table:
    """A table of items, one row each, its header and its rows from the same columns."""
    return Table([c.header for c in columns], [[c.cell(i) for c in columns] for i in items], caption)


@dataclass
class Figure:
    name: str  # the file name (without extension) next to the Markdown, and the HTML img id
    image: bytes  # SVG
    alt: str


@dataclass
class Items:
    """A bulleted list."""

    items: list[str]


@dataclass
class Code:
    """Verbatim text (an error excerpt)."""

    text: str


@dataclass
class Section:
    """A report section. The sweep report's sections fill text, images and tables (written in that
    order); `body` holds blocks in reading order (str: a paragraph, Table, Figure, Items, Code),
    written after them. A section without a title is the report's lead: no heading, not in the
    table of contents."""

    id: str
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[tuple[str, bytes, str]] = field(default_factory=list)  # (name, svg, alt)
    body: list = field(default_factory=list)

    def blocks(self) -> list:
        return [*self.text, *(Figure(*i) for i in self.images), *self.tables, *self.body]

    def figures(self) -> list[Figure]:
        return [b for b in self.blocks() if isinstance(b, Figure)]
