"""The comparison report's memory census (each run's bytes by category and dtype at its first optimizer step)
and the FLOP convention its MFU columns use, as harness.model.flops counts it for the compared workload. They
lay out what the records say."""

from __future__ import annotations

NOT_MEASURED = "not measured"


CENSUS_TEXT = (
    "Bytes rank 0 held at its first optimizer step, by category and dtype, counted from the tensors "
    "the engine really holds (each storage once), and in bytes per parameter of the model (xP: fp32 "
    "parameters are 4.00P, a shard of them over 2 ranks 2.00P); activations: what autograd saved for "
    "backward, per micro-batch. What a framework holds beyond the policy is shown as it is."
)
BUFFERS_TEXT = (
    "Communication buffers: the buckets a framework keeps for its collectives (DeepSpeed ZeRO-3's reduce "
    "bucket of zero_optimization.reduce_bucket_size elements, held for the whole run), sized by its "
    "config, not by the model: given in elements, not per parameter; '-' where the engine keeps none "
    "at the step."
)


def census_text(summary: dict) -> list[str]:
    """What the census table shows: its buffers column explained only where it is shown; what P is."""
    shown = any(((r.get("metrics") or {}).get("memory_census") or {}).get("buffers") for r in summary["runs"])
    t = _palm_terms(summary)
    p = [f"P = {t['P']:,}: every parameter of the model" + (", all experts." if t["N"] != t["P"] else ".")] if t else []
    return [CENSUS_TEXT, *p, BUFFERS_TEXT] if shown else [CENSUS_TEXT, *p]


def _palm_terms(summary: dict) -> dict | None:
    """harness.model.flops.palm_terms of the compared workload (None where the summary's workload is not one)."""
    from harness.errors import SpecError
    from harness.model.flops import palm_terms
    from harness.spec import parse_spec

    try:
        spec = parse_spec({"workload": summary["workload"]})
        return palm_terms(spec.shape(), spec.workload.seq_len)
    except (SpecError, KeyError, TypeError, ValueError):
        return None


def flop_text(summary: dict) -> list[str]:
    """The MFU's FLOP convention, term by term, as harness.model.flops counts it for this workload."""
    t = _palm_terms(summary)
    if t is None:
        return []
    moe = t["N"] != t["P"]
    return [
        f"PaLM's FLOPs per token, as the harness counts them: 6N + 12·L·h·s = 6 x {t['N']:,} + 12 x {t['L']} x "
        f"{t['h']} x {t['s']} = {t['per_token']:,}. N = {t['N']:,}: the parameters a token passes through, the "
        "input embedding (a lookup, no matmul) and the LM head (once where tied) included, with every attention "
        "projection and RMSNorm weight"
        + (
            f"; under MoE its routed experts and the router only, not every expert: N is not the census's "
            f"P = {t['P']:,} (every parameter)"
            if moe
            else f" (every parameter: N = P = {t['P']:,})"
        )
        + ". 12·L·h·s: the attention matmuls QKᵀ and AV over the whole sequence, no causal halving (L layers, "
        "h hidden size, s sequence length)."
    ]


def _buffer_cell(by_dtype: dict | None) -> str:
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    if not by_dtype:
        return "-"
    return ", ".join(
        f"{dtype} {n / 2**20:,.2f} MiB" + (f" ({n // size[dtype]:,} elements)" if dtype in size else "")
        for dtype, n in sorted(by_dtype.items())
    )


def _census_cell(by_dtype: dict | None, params: int | None) -> str:
    if not by_dtype:
        return "none" if by_dtype is not None else NOT_MEASURED
    return ", ".join(
        f"{dtype} {n / 2**20:,.2f} MiB" + (f" ({n / params:.2f}P)" if params else "")
        for dtype, n in sorted(by_dtype.items())
    )


def census_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's memory census (rank 0) and saved activations; 'not measured' where absent."""
    categories = ("parameters", "gradients", "master_parameters", "optimizer_states")
    censuses = [(r.get("metrics") or {}).get("memory_census") for r in summary["runs"]]
    buffers = any((c or {}).get("buffers") for c in censuses)  # the column only where some run keeps one
    header = ["run"] + [c.replace("_", " ") for c in categories]
    header += ["communication buffers"] * buffers + ["activations saved / micro-batch"]
    rows = []
    for r, census in zip(summary["runs"], censuses, strict=True):
        m = r.get("metrics") or {}
        params, act = m.get("parameter_count"), m.get("activations_saved_bytes")
        rows.append(
            [r["label"]]
            + [_census_cell(census.get(c, {}) if census is not None else None, params) for c in categories]
            + ([_buffer_cell(census.get("buffers")) if census is not None else NOT_MEASURED] if buffers else [])
            + [f"{act / 2**20:,.2f} MiB" if act is not None else NOT_MEASURED]
        )
    return header, rows
