"""The CLI's `--set key.path=value` overrides (add_set_argument), applied to a raw spec before it is
checked; an error at an overridden path names the override. Used by train, memory, compare and sweep.
"""

from __future__ import annotations

from harness.errors import SpecError
from harness.files.yaml_reader import load_yaml


def parse_with_overrides(raw, overrides: list[str] | None, parse, prefix: str = ""):
    """`parse(raw)` after the CLI's `--set key.path=value` overrides, applied in order to the raw
    mapping (before any validation). A value is YAML (`256`, `naive`, `true`, `[1, 2]`); a path
    walks mappings (a key that itself holds dots, like a sweep's `workload.seq_len` axis, is
    matched whole) and list indices (`runs.0.engine`), creating missing mappings. A malformed
    override, or a validation error at an overridden path (or above it) (`prefix` is how the parser
    names the spec's top level, e.g. `sweep.`), is `--set: ...`."""
    if not overrides:
        return parse(raw)
    if raw is None:
        raw = {}
    paths = {}
    for text in overrides:
        path, eq, value_text = text.partition("=")
        parts = path.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise SpecError("--set", f"{text!r}: give KEY.PATH=VALUE, e.g. workload.seq_len=256")
        try:
            value = load_yaml(value_text, path) if value_text.strip() else None
        except SpecError as e:
            raise SpecError("--set", f"{path}: {e.reason}") from None
        if not isinstance(raw, dict):
            raise SpecError("--set", f"{path}: the spec's top level is not a mapping")
        node, i, walked = raw, 0, []
        while True:
            if isinstance(node, dict):  # the longest dotted key already present, else one part
                j = next((j for j in range(len(parts), i + 1, -1) if ".".join(parts[i:j]) in node), i + 1)
                key = ".".join(parts[i:j])
            elif isinstance(node, list):
                j, key = i + 1, parts[i]
                if not key.isdigit() or int(key) >= len(node):
                    raise SpecError(
                        "--set", f"{path}: {'.'.join(walked)} is a list of {len(node)}; {key!r} is not an index into it"
                    )
                key = int(key)
            else:
                raise SpecError("--set", f"{path}: {'.'.join(walked)} is {node!r}, not a mapping")
            walked.append(str(key))
            if j == len(parts):
                node[key] = value
                break
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node, i = node[key], j
        paths[prefix + ".".join(walked)] = f"{'.'.join(walked)}={value_text.strip()}"
    try:
        return parse(raw)
    except SpecError as e:
        hit = next((t for p, t in paths.items() if p == e.field or p.startswith(e.field + ".")), None)
        if hit is not None:  # at an overridden path, or at a mapping the override made
            raise SpecError("--set", f"{hit}: {e.reason}") from None
        raise
