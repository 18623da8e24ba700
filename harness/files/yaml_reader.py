"""Reading a user's YAML (a spec file, a --set value): strict and bounded, so a mistake is one SpecError.

PyYAML keeps the last of a key given twice (the first is silently lost), and expands aliases
without a limit (ten nested aliases make 10^9 values from 200 bytes: minutes, then a MemoryError).
Every spec file goes through here: a key given twice, a file beyond MAX_BYTES, a document whose
aliases expand beyond MAX_VALUES, a recursive alias or a nesting too deep for the parser is refused.
"""

from __future__ import annotations

import os

import yaml

from harness.errors import SpecError

MAX_BYTES = 1 << 20  # the largest spec the repository ships is 2 KB; a sweep of hundreds of points, 100 KB
MAX_VALUES = 100_000  # scalars, lists and mappings once aliases are expanded (a spec holds hundreds)
MAX_DEPTH = 100  # levels of nesting (a spec has 4; PyYAML's scanner slows with the square of the depth)


class _TooLarge(yaml.MarkedYAMLError):
    """A document nested too deeply, whose aliases expand beyond MAX_VALUES, or refer to themselves."""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (merge keys `<<` may still be
    overridden, as YAML means them) and a document nested too deeply or whose aliases expand too far."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _TooLarge(None, None, f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _expanded(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader says so below
                    continue
                if earlier is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice (first on line {earlier.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def _expanded(node, memo: dict, open_: set) -> int:
    """How many values `node` stands for with every alias expanded (an alias is the same node
    object again, so memo keeps this linear in the text; the depth is MAX_DEPTH at most)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise _TooLarge(None, None, "an alias refers to the value that holds it", node.start_mark)
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        count = 1 + sum(_expanded(child, memo, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        count = 1 + sum(_expanded(k, memo, open_) + _expanded(v, memo, open_) for k, v in node.value)
    else:
        count = 1
    open_.discard(key)
    if count > MAX_VALUES:
        raise _TooLarge(
            None,
            None,
            f"its aliases expand it to more than {MAX_VALUES} values (a spec holds hundreds)",
            node.start_mark,
        )
    memo[key] = count
    return count


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: where and what (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(e, "problem", None) or (str(e).strip().splitlines() or ["unreadable"])[0]
    return f"not valid YAML: {where}{problem}"


def load_yaml(text: str, field: str):
    """`text` as YAML through StrictLoader, or a SpecError naming `field`."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise SpecError(field, yaml_problem(e)) from None


def read_yaml(path: str, field: str = "spec"):
    """A user's YAML file, or a SpecError naming `field` (missing) or the file (malformed, empty, too large)."""
    if not os.path.isfile(path):
        raise SpecError(field, f"file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise SpecError(path, f"is {os.path.getsize(path):,} bytes; a spec file is at most {MAX_BYTES:,}")
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(path, f"cannot read it: {e}") from None
    raw = load_yaml(text, path)
    if raw is None:
        raise SpecError(path, "is empty (no spec in it)")
    return raw
