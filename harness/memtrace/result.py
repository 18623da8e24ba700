"""Trace every pipeline stage of a spec and put the result beside the planner's prediction:
the JSON object `harness memory --format json` prints, and its table."""

from __future__ import annotations

import time

from harness.memtrace.terms import named_terms, pipelined, planner_stages
from harness.memtrace.trace import check_traceable, stage_ranks, substitutions, trace_rank
from harness.parallel_dims import LABEL_ORDER

GIB = 1024**3


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def trace_spec(spec, profile=None) -> dict:
    """Trace each pipeline stage's first rank; per rank the census, the live peak and the named
    terms; `traced_peak_gib` the worst rank with its terms, `planner_peak_gib` the planner's
    worst stage for the same layout and engine."""
    check_traceable(spec)
    shape = spec.shape()
    t0 = time.perf_counter()
    worst_stage, planned = planner_stages(spec, shape)
    piped = pipelined(spec)
    ranks = []
    for rank in stage_ranks(spec.layout):
        tr = trace_rank(spec, shape, rank)
        terms = named_terms(tr.live_peak_bytes - tr.states_bytes, piped)
        total = tr.live_peak_bytes + sum(terms.values())
        ranks.append(
            {
                "rank": tr.rank,
                "stage": tr.stage,
                "layers": tr.layers,
                "census": {c: {d: int(b) for d, b in by.items()} for c, by in tr.census.items()},
                "census_gib": {c: _gib(sum(by.values())) for c, by in tr.census.items()},
                "states_gib": _gib(tr.states_bytes),
                "live_peak_gib": _gib(tr.live_peak_bytes),
                "peak_at": tr.peak_at,
                "forward_backward_peak_gib": _gib(tr.forward_backward_peak_bytes),
                "optimizer_step_peak_gib": _gib(tr.optimizer_peak_bytes),
                "saved_activations_gib": _gib(tr.saved_bytes_step),
                "saved_per_forward_gib": _gib(tr.saved_bytes_forward),
                "terms_gib": {k: _gib(v) for k, v in terms.items()},
                # the caching allocator's reserved bytes, the traced step replayed through its rules over steps
                # (allocator.py): with its default segments and with expandable_segments:True
                "reserved_gib": {k: _gib(v) for k, v in tr.extra.get("reserved", {}).items() if k != "allocated"},
                "total_gib": _gib(total),
                "planner_gib": _gib(planned[tr.stage]["total"]),
                "micro_batches": tr.micro_batches,
                "micro_batches_traced": tr.micro_batches_traced,
                "seconds": round(tr.seconds, 2),
            }
        )
    worst = max(ranks, key=lambda r: r["total_gib"])
    out = {
        "name": spec.name,
        "model": spec.workload.model,
        "seq_len": spec.workload.seq_len,
        "global_batch_size": spec.workload.global_batch_size,
        "precision": spec.workload.precision,
        "engine": spec.layout.engine,
        "layout": {
            k: getattr(spec.layout, k)
            for k in (
                *LABEL_ORDER,
                *(
                    "cp_impl micro_batch_size activation_checkpointing sequence_parallel attention rmsnorm "
                    "pipeline_schedule virtual_stages zero_stage reshard_after_forward"
                ).split(),
            )
        },
        "traced_peak_gib": worst["total_gib"],
        "traced_worst_stage": worst["stage"],
        "planner_peak_gib": _gib(planned[worst_stage]["total"]),
        "planner_worst_stage": worst_stage,
        "substitutions": substitutions(spec),
        "ranks": ranks,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if profile is not None:
        out["hardware"] = profile.name
        out["device_memory_gib"] = profile.memory_gib
        out["fits"] = out["traced_peak_gib"] <= profile.memory_gib
    return out


def table_lines(result: dict) -> list[str]:
    lay = result["layout"]
    cp = f"cp {lay['cp']} {lay['cp_impl']} " if lay.get("cp", 1) > 1 else ""
    head = (
        f"{result['model']} seq {result['seq_len']} batch {result['global_batch_size']} {result['precision']}, "
        f"engine {result['engine']}: tp {lay['tp']} {cp}pp {lay['pp']} dp {lay['dp']} mb {lay['micro_batch_size']} "
        f"ckpt {lay['activation_checkpointing']} sp {'on' if lay['sequence_parallel'] else 'off'} "
        f"{lay['attention']}/{lay['rmsnorm']} "
        + (
            f"reshard_after_forward {lay['reshard_after_forward']}"
            if result["engine"] == "fsdp"
            else f"zero {lay['zero_stage']}"
        )
    )
    lines = [
        head,
        f"{'stage':>5} {'layers':>9} {'params':>7} {'grads':>7} {'master':>7} {'adam':>7} "
        f"{'live pk':>8} {'context':>8} {'frag':>6} {'total':>7} {'planner':>8}  peak at",
    ]
    for r in result["ranks"]:
        c = r["census_gib"]
        layers = ",".join(f"{a}-{b - 1}" for a, b in r["layers"])
        lines.append(
            f"{r['stage']:>5} {layers:>9} {c.get('parameters', 0):7.2f} {c.get('gradients', 0):7.2f} "
            f"{c.get('master_parameters', 0):7.2f} {c.get('optimizer_states', 0):7.2f} "
            f"{r['live_peak_gib']:8.2f} {r['terms_gib']['cuda_context_and_workspaces']:8.2f} "
            f"{r['terms_gib']['allocator_fragmentation']:6.2f} {r['total_gib']:7.2f} {r['planner_gib']:8.2f}"
            f"  {r['peak_at']}"
        )
    diff = (result["planner_peak_gib"] - result["traced_peak_gib"]) / result["traced_peak_gib"] * 100
    lines.append(
        f"traced peak {result['traced_peak_gib']:.2f} GiB (stage {result['traced_worst_stage']}, all terms); "
        f"planner {result['planner_peak_gib']:.2f} GiB (stage {result['planner_worst_stage']}): {diff:+.1f}%"
    )
    if "fits" in result:
        lines.append(
            f"{'fits' if result['fits'] else 'does not fit'} on {result['hardware']} "
            f"({result['device_memory_gib']:.2f} GiB)"
        )
    lines.append(
        "GiB per GPU; census at the optimizer step; live pk: the largest sum of live tensors in the step; "
        "context and frag: what the trace cannot see (planner/memory_terms.py)"
    )
    reserved = "; ".join(
        f"stage {r['stage']} {r['reserved_gib']['segments']:.2f} ({r['reserved_gib']['expandable']:.2f} expandable)"
        for r in result["ranks"]
        if r.get("reserved_gib")
    )
    if reserved:  # what torch.cuda.max_memory_reserved() would read (torchtitan logs it), CUDA context excluded
        lines.append(f"reserved by the caching allocator, the step replayed through its rules (GiB): {reserved}")
    for s in result["substitutions"]:
        lines.append(f"traced as on the GPU: {s}")
    per_stage = ", ".join(f"stage {r['stage']} {r['seconds']:.1f} s" for r in result["ranks"])
    lines.append(f"traced in {result['seconds']:.1f} s ({per_stage})")
    return lines
