"""What a reader needs to run a comparison's runs again: the command and spec it was started with, the
versions (harness commit, torch, each framework), every run's launch command and resolved engine
settings (what the JSON holds, flattened), and its trace files kept beside the report, never a link
into a folder the report does not carry."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from urllib.parse import quote

from harness.report.sections import Code, Items, Section

# Settings stated once elsewhere in the report (the precision policy, the workload's optimizer), or that
# name a rank rather than the run (its coordinates, the rank map), or list the keys the harness filled in.
_SKIP = {
    "precision_policy",
    "coord",
    "rank_map",
    "ds_config_auto_filled",
    "ds_config.optimizer",
    "ds_config.steps_per_print",
}
_LONGEST = 240  # a setting's value beyond this many characters is cut (the JSON holds it whole)


def _flat(prefix: str, value, out: list[tuple[str, str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if key not in _SKIP:
                _flat(key, v, out)
        return
    text = json.dumps(value, default=str) if isinstance(value, list) else str(value)
    out.append((prefix, text if len(text) <= _LONGEST else text[: _LONGEST - 3] + "..."))


def engine_settings(run: dict) -> list[tuple[str, str]]:
    """A run's resolved engine settings as (dotted key, value): every entry of its engine's describe()
    (DeepSpeed's ds_config as the engine ran it: zero_optimization.overlap_comm, reduce_bucket_size...;
    FSDP2's tensor-parallel plan; the pipeline's classes) and the kernels the run chose."""
    out: list[tuple[str, str]] = []
    _flat("", run.get("describe") or {}, out)
    m = run.get("metrics") or {}
    for key in ("attention_backend", "rmsnorm_backend"):
        if m.get(key):
            out.append((key, str(m[key])))
    return out


def versions_text(summary: dict) -> str:
    """'harness commit 1a2b3c4..., torch 2.13.0, deepspeed 0.19.8, ...' from the summary's
    versions and the runs' fingerprints (each name once; a version that differs between runs is listed
    by the fingerprint section)."""
    v = summary.get("versions") or {}
    parts = []
    if v.get("harness_commit"):
        parts.append(f"harness commit {v['harness_commit'][:12]} (uncommitted changes, if any, not recorded)")
    else:
        parts.append("harness commit not recorded (not run from a git checkout, or a summary written before it)")
    fps = [r.get("fingerprint") or {} for r in summary["runs"]]
    for key, name in (("torch", "torch"), ("deepspeed", "DeepSpeed"), ("megatron_core", "Megatron-core")):
        found = sorted({str(fp[key]) for fp in fps if fp.get(key)})
        if found:
            parts.append(f"{name} {' / '.join(found)}")
    python = sorted({str(fp["python"]) for fp in fps if fp.get("python")})
    return ", ".join(parts + ([f"Python {' / '.join(python)}"] if python else []))


def _command(run: dict) -> str:
    cmd = run.get("command")
    return shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd or "")


def engines_section(summary: dict) -> Section:
    """How the comparison was started, at which versions, and each run's launch command and settings."""
    inv = summary.get("invocation") or {}
    body = []
    if inv.get("command"):
        spec = inv.get("spec") or "the built-in default comparison (harness/compare/spec.py DEFAULT)"
        body.append(f"Started as `{inv['command']}` (spec: `{spec}`).")
    else:
        body.append("How this comparison was started was not recorded (a summary written before it was).")
    body.append(f"Versions: {versions_text(summary)}.")
    body.append(
        "Each run's resolved spec (layout and workload as the run received them) is in the JSON beside this "
        "report (runs[].spec), with its launch command (runs[].command; the spec file it names was a copy "
        "written to the comparison's log folder). Per run, the launch command and the engine's resolved settings:"
    )
    for r in summary["runs"]:
        settings = "; ".join(f"{k}: {v}" for k, v in engine_settings(r))
        body.append(Items([f"**{r['label']}** (launcher `{r['launcher']}`): {settings or 'no settings recorded'}"]))
        if _command(r):
            body.append(Code(_command(r)))
    return Section("engines", "Engines", body=body)


def traces_dir(summary: dict) -> str:
    """The traces' folder, relative to the report: the Markdown links them from there."""
    return f"compare-{summary['name']}-traces"


def keep_traces(summary: dict, out_dir: str, files=None) -> None:
    """Copy each run's kept trace files beside the report (traces_dir), setting each trace's `file` to its
    path relative to the report; a trace whose file is gone keeps no `file` (its link is dropped)."""
    folder = traces_dir(summary)
    for r in summary["runs"]:
        for t in r.get("traces") or []:
            src = str(t.get("path") or "")
            name = os.path.basename(src)
            dest = os.path.join(out_dir, folder, name)
            if src and os.path.isfile(src):
                if os.path.abspath(src) != os.path.abspath(dest):
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    if files is None:
                        shutil.copyfile(src, dest)
                    else:
                        with open(src, "rb") as f:
                            files.write(dest, f.read())
                t["file"] = f"{folder}/{name}"
            elif not (t.get("file") and os.path.isfile(os.path.join(out_dir, t["file"]))):
                t.pop("file", None)


def trace_links(run: dict) -> str:
    """A run's trace links, only to the files keep_traces put beside the report; a word for the others."""
    traces = run.get("traces") or []
    kept = [t for t in traces if t.get("file")]
    links = ", ".join(f"[{_trace_name(t)}]({quote(t['file'], safe='/:._-~')})" for t in kept)
    missing = len(traces) - len(kept)
    if missing:
        links += ("; " if links else "") + f"{missing} trace file(s) not kept beside this report (not linked)"
    return links or "no trace kept"


def _trace_name(trace: dict) -> str:
    rank = f"rank {trace.get('rank')}"
    role = trace.get("role") or rank
    return role if role == rank else f"{role} ({rank})"
