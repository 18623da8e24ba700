"""The planner's time features of one layer and one pipeline stage: the ideal seconds of each kind of
work (GEMMs and flash attention by FLOPs, the rest by HBM bytes, collectives and sends by link bytes,
kernel launches), each divided by its efficiency in timing.py. The constants are the literature's
or calibrated (their comments say which)."""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner import feedforward, fp8, schedules
from harness.planner import memory_recipes as recipes
from harness.planner.context import exchange_bytes
from harness.planner.hardware import EFFICIENCY_KEYS, Profile
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PlannerLayout, Workload, item_split
from harness.planner.rates import gemm_eff, group_geometry, link_bandwidth, link_of

# Flash attention backward does 2.5x the forward's matmul FLOPs (5 matmuls against 2, Dao 2023).
FLASH_BWD = 2.5
# A flash kernel's rate grows with the sequence: each query block pays a fixed cost (load Q,
# rescale and write O and the logsumexp) and, under the causal mask, computes its diagonal key
# block in full, so the useful work per query block is s/2 keys against a fixed ~FLASH_HALF_SEQ/2:
# rate ~ s / (s + FLASH_HALF_SEQ). 512 = four 128-key blocks reproduces the rise of
# FlashAttention-2's causal forward+backward throughput from 2k to 8k tokens on A100 (about 20%,
# Dao 2023, "FlashAttention-2", Fig. 4, head dim 128). The efficiency constants (flash1, flash2,
# mem_efficient) are the long-sequence limits. Without it, constants fitted at 2048 tokens
# under-predict flash attention at 8192 (FlashAttention-2 MFU at 8192 3-6 points low).
FLASH_HALF_SEQ = 512
# HBM bytes per element moved by elementwise work, forward + backward (counted from the kernels):
RMSNORM_BYTES = {"fused": 10, "torch": 108}  # fused: fwd r+w, bwd r x,dy w dx; eager fp32 chain ~9 kernels
RESIDUAL_BYTES_PER_B = 6  # per residual add: fwd reads 2 writes 1, bwd passes the gradient on
ROTARY_BYTES_PER_B = 4  # q and k read and written, fwd and bwd (SwiGLU's: feedforward.SWIGLU_BYTES_PER_B)
LAYOUT_BYTES_PER_B = 4  # q/k/v split and transposes around the attention kernel
SCORE_TRAFFIC = {"naive": 90, "fused_softmax": 24}  # bytes per score element fwd+bwd (fp32 chain vs one fused pass)
LOSS_BYTES_PER_LOGIT = 36  # fp32 upcast, max, exp, sum, log-softmax grad, bf16 cast
ADAM_BYTES_PER_PARAM = 36  # read fp32 master, m, v, grad (16), write them (12... + 4), write bf16 copy (2),
# zero grad (2)
KERNELS_PER_LAYER = 90  # ~30 forward kernels (norms, GEMMs, rotary, attention, SwiGLU, adds), ~2x backward
# A compiled block (PlannerLayout.compile "blocks", torch.compile's Inductor) fuses each elementwise chain
# into one kernel: its norm is a fused norm (PlannerLayout.norm_kernel, memory too), and what remains to
# launch is ~7 GEMMs, the attention kernel and ~5 fused kernels forward, ~2x backward (counted from the
# graph). SwiGLU's traffic stays eager's: a fused SwiGLU (8 f-sized passes, not 13) is what Inductor emits,
# but with it the published compile rows (torchtitan, torchao) fit only with hbm pinned at its bound of 1.0
# and a worse median (4.7% against 4.3%), so the data do not support that term on top of the others yet.
SWIGLU_BYTES_COMPILED = feedforward.SWIGLU_BYTES_PER_B
KERNELS_PER_LAYER_COMPILED = 40


# Allocator pressure: a cost per optimizer step that grows with how full the device is. PyTorch's
# caching allocator serves a request it cannot fit from its cache by calling cudaMalloc; when that
# fails it synchronizes, frees every cached unused block and retries (torch.cuda.memory_stats:
# "num_alloc_retries: number of failed cudaMalloc calls that result in a cache flush and retry"),
# and the freed blocks are cudaMalloc'ed again, synchronously, on their next use. DeepSpeed's engine
# warns of it for the same reason ("pytorch allocator cache flushes since last step. this happens
# when there is high memory pressure and is detrimental to performance"). A flush on one rank stalls
# its pipeline neighbours and its collectives, so the cost is paid per step, not per token. Modelled
# as ALLOC_PRESSURE_S x max(0, min(1, predicted peak / device memory) - ALLOC_PRESSURE_FROM) seconds
# per step; ALLOC_PRESSURE_S is calibrated with the efficiencies (key 'alloc_pressure_s', stored in
# a profile's `calibrated` block), this value is its prior.
# Evidence in the published sweeps (tests/test_planner_paper.py): the per-step constant D of the
# same layout on 2x / 4x the GPUs grows with the micro-batch size in pipelined runs far beyond the
# 1F1B bubble (13B tp2 pp2: 1.8, 4.0, 6.7 s at mb 1, 2, 4; 30B tp2 pp4: 4.1, 7.4 s at mb 1, 2) as
# their memory rises past ~2/3 of the device, and layouts near the limit ran slower than their
# compute allows (30B tp4 pp1 without checkpointing: 4-10 MFU points below the prediction). Each
# sweep fitted alone wants it (3.5 to 6.4 s; 8.7 s on all four, about 3 s per step at a full
# device). With it, mean Spearman held out by sweep 0.879 -> 0.907 and by model 0.869 -> 0.883
# (13B-32 alone 0.80 -> 0.87), median MFU error 1.68 -> 1.66 and 1.79 -> 1.62 points, step-time
# error of the shared fit 3.8% -> 3.4%. Not all of it fits: 13B tp1 pp1 dp64 at a predicted 79 GiB
# was the fastest 13B run. The threshold is not sharp in the data (0.6 to 0.68 score alike, held
# out); no published measurement gives the constant, so its prior is a round 5 s, weakly held
# (a prior of 3 s scores 0.89 / 0.87 held out, 5 to 9 s alike).
ALLOC_PRESSURE_FROM = 0.65
ALLOC_PRESSURE_S = 5.0
# Constants of the time model beyond the hardware profile's efficiencies: seconds per step per unit
# of allocator pressure (above). Calibrated with the efficiencies; theta_from_profile reads them.
EXTRA_KEYS = ("alloc_pressure_s",)
THETA_KEYS = EFFICIENCY_KEYS + EXTRA_KEYS


def _flash_seq_eff(s: int) -> float:
    """The share of a flash kernel's rate reached at sequence length s: s / (s + FLASH_HALF_SEQ)."""
    return s / (s + FLASH_HALF_SEQ)


def zero_features() -> dict[str, float]:
    return {k: 0.0 for k in THETA_KEYS}


def layer_features(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, theta: dict | None = None
) -> dict[str, float]:
    """Ideal seconds of each kind of work of one transformer layer for one micro-batch (forward +
    backward): the same on every stage, so computed once per layout (stage_features scales it).
    Under context parallelism everything but the attention runs on the rank's seq / cp tokens; the
    attention attends them to every key (ulysses: every token of 1/cp of the heads), and the cp
    exchange is priced on its link, the ring's only where its transfers outlast the attention of
    a block (theta: whose efficiencies decide that, the profile's by default)."""
    x = zero_features()
    b, s, h, t, B = lay.micro_batch_size, wl.local(lay).seq_len, shape.hidden, lay.tp, wl.dtype_bytes
    n = b * s
    d = shape.head_dim
    kv = shape.kv_heads * d
    peak = prof.peak_flops(B)
    hbm = prof.hbm_gbps * 1e9
    again = recipes.recompute_fraction(shape, lay)  # the recomputed forward's share (recompute_layers)
    per_op = recipes.per_op_gemm_passes(shape, lay)  # torchtitan's per-op checkpointing: its GEMMs run again
    if per_op:
        again = 1.0  # its elementwise work and launches are recomputed (memory_recipes)
    passes = 3 + again  # fwd + bwd (2x fwd) + recomputed fwd
    # GEMMs of one layer: (N, K) per GEMM, M = n tokens; under fp8 at the FP8 peak, their own efficiency.
    q = shape.heads * d  # the query width (hidden unless the head width is set apart: Qwen3's kv_channels)
    ffn = feedforward.of(shape)  # dense SwiGLU or a mixture of experts (feedforward.py)
    gemms = [((q + 2 * kv) / t, h), (h, q / t)] + ffn.gemms(t)
    gemm_key, gemm_peak = ("gemm_fp8", prof.peak_flops_fp8()) if lay.precision == "fp8" else ("gemm", peak)
    for i, (N, K) in enumerate(gemms):
        p = 3 + per_op[i] if per_op and i < len(per_op) else passes
        x[gemm_key] += p * 2 * n * N * K / (gemm_peak * gemm_eff(n, N, K))
    attention = attention_features(shape, lay, wl, prof)
    for k, v in attention.items():
        x[k] += v
    # Elementwise work, by HBM bytes; norms and residual adds are split only by sequence parallelism.
    rep = 1 / t if lay.sequence_parallel else 1.0
    recf = 1 + again / 3
    compiled = lay.compile == "blocks"
    swiglu = SWIGLU_BYTES_COMPILED if compiled else feedforward.SWIGLU_BYTES_PER_B
    per_layer = (2 * RMSNORM_BYTES[lay.norm_kernel] * (B / 2) + 2 * RESIDUAL_BYTES_PER_B * B) * n * h * rep
    per_layer += (swiglu * ffn.width() + (ROTARY_BYTES_PER_B + LAYOUT_BYTES_PER_B) * (q + 2 * kv)) * B * n / t
    if lay.precision == "fp8":  # the casts to fp8 and their amax (fp8.py), recomputed under full checkpointing
        m = wl.micro_batches(lay)  # (a MoE layer's: its tokens' expert width, its rank's experts' weights)
        per_layer += fp8.activation_cast_bytes(ffn.token_shape(lay), lay, n, B)
        per_layer += fp8.weight_cast_bytes(ffn.weight_shape(lay.ep), lay, m, B)
    x["hbm"] += per_layer * recf / hbm
    for k, v in ffn.routed_features(lay, n, B, prof, gemm_key, gemm_peak).items():  # MoE: router, experts, all-to-all
        x[k] += v
    # Tensor-parallel collectives: per layer 2 all-reduces forward and 2 backward (all-gather +
    # reduce-scatter under sequence parallelism: the same bytes), each of n*h elements.
    if t > 1:
        key = link_of(prof, t)
        x[key] += (4 + (1 if per_op else 2 * again)) * 2 * (t - 1) / t * n * h * B / link_bandwidth(prof, key)
    if lay.cp > 1:
        key, exposed, _ = cp_exchange(shape, lay, wl, prof, theta, attention)
        x[key] += exposed
    kernels = KERNELS_PER_LAYER_COMPILED if compiled else KERNELS_PER_LAYER
    x["launch_us"] += 1e-6 * kernels * (1 + again / 3)
    return x


def attention_features(shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile) -> dict[str, float]:
    """Ideal seconds of one layer's attention core for one micro-batch (forward, backward and the
    recomputation), by kind of work; under cp the rank's queries against every key."""
    b, s, t, B = lay.micro_batch_size, wl.local(lay).seq_len, lay.tp, wl.dtype_bytes
    d = shape.head_dim
    peak = prof.peak_flops(B)
    cls = ATTENTION_CLASS[lay.attention]
    heads_t = shape.heads / t
    s_kv = s * lay.cp  # the keys a local query attends (ring, allgather); ulysses: the same products
    rec = recipes.recompute_fraction(shape, lay) if lay.activation_checkpointing == "full" else 0.0
    if lay.activation_checkpointing == "selective":  # torchtitan's per-op policy keeps the kernel's output
        rec = 0.0 if lay.selective_policy == "per_op" else 1.0
    if cls in MATERIALISED:
        score_key = "naive_attention" if cls == "naive" else cls
        # every score computed, masked ones too: the own engine's ring computes its own block whole and
        # half of each other rank's (context_parallel._ring_rows), allgather and ulysses one block of all keys
        keys = s * (lay.cp + 1) / 2 if lay.cp > 1 and lay.cp_impl == "ring" else s_kv
        return {
            "gemm": (3 + rec) * 4 * b * s * keys * heads_t * d / (peak * gemm_eff(s, keys, d)),
            score_key: (SCORE_TRAFFIC[cls] * (1 + rec / 3)) * b * heads_t * s * keys / (prof.hbm_gbps * 1e9),
        }
    fwd = 2 * b * s * s_kv * heads_t * d  # QK^T and AV under the causal mask (half of 4 s^2 d)
    # the kernel's length: a ring's block (the local chunks), allgather's local queries, Ulysses' sequence
    kernel_len = s * lay.cp if lay.cp > 1 and lay.cp_impl == "ulysses" else s
    return {cls: fwd * (1 + FLASH_BWD + rec) / (peak * _flash_seq_eff(kernel_len))}


def cp_exchange(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, theta: dict | None, attention: dict
) -> tuple[str, float, float]:
    """The link of the cp group, the ideal seconds of its exchange for one layer and micro-batch that
    the attention does not hide, and those of all of it (harness/planner/context.py for the bytes). The ring overlaps
    each transfer with one block's attention: per step max(0, transfer - block compute) at the
    efficiencies of `theta`, expressed in the link's ideal seconds so that the step time stays a
    sum of theta x features; allgather and ulysses are not overlapped. `attention`: the ideal
    seconds of the layer's attention core by kind of work."""
    theta = theta or theta_from_profile(prof)
    key = link_of(prof, group_geometry(lay.dims, "span", "cp"))
    ex = exchange_bytes(shape, lay, wl.seq_len, wl.dtype_bytes)
    total = ex["total"] / link_bandwidth(prof, key)
    if lay.cp_impl != "ring":
        return key, total, total
    steps = ex["steps"]
    transfer = theta[key] * total / steps  # real seconds per transfer
    block = dot(theta, attention) / steps  # the attention of one step's block (real seconds)
    return key, steps * max(0.0, transfer - block) / theta[key], total


def stage_extras(shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, stage: int) -> dict[str, float]:
    """Ideal seconds of the work of one stage beyond its layers, for one micro-batch: the LM head
    with the loss, the embedding's and head's tensor-parallel collectives, the pipeline sends."""
    has_emb, layers, has_head = item_split(shape.layers, lay.pp)[stage]
    x: dict[str, float] = {}
    n, h, t, B = lay.micro_batch_size * wl.local(lay).seq_len, shape.hidden, lay.tp, wl.dtype_bytes

    def add(k: str, v: float) -> None:
        x[k] = x.get(k, 0.0) + v

    if has_head:
        # The LM head is column-parallel but its output is all-gathered (parallel_output=False in
        # the study's framework) and every tensor-parallel rank runs the cross-entropy over the
        # full vocabulary: the GEMM splits over tp, the loss's memory-bound passes do not.
        peak = prof.peak_flops(B)
        add("gemm", 3 * 2 * n * h * shape.vocab / t / (peak * gemm_eff(n, h, shape.vocab / t)))
        add("hbm", n * shape.vocab * LOSS_BYTES_PER_LOGIT / (prof.hbm_gbps * 1e9))
        if t > 1:
            add(link_of(prof, t), (t - 1) / t * n * shape.vocab * B / link_bandwidth(prof, link_of(prof, t)))
    # Tensor-parallel collectives of the embedding and the head (the layers' are per layer).
    if t > 1 and (has_emb or has_head):
        key = link_of(prof, t)
        add(key, 2 * (has_emb + has_head) * 2 * (t - 1) / t * n * h * B / link_bandwidth(prof, key))
    # Pipeline sends: activation forward, its gradient backward (split over tp with scatter-gather).
    if lay.pp > 1:
        key = link_of(prof, 2 * group_geometry(lay.dims, "stride", "pp"))  # two neighbouring stages' blocks of ranks
        sends = schedules.sends_per_micro_batch(lay.pipeline_schedule, lay.virtual_stages, lay.pp, stage)
        add(key, sends * 2 * n * h * B / t / link_bandwidth(prof, key))
    if has_emb or has_head:
        add("launch_us", 1e-6 * 20 * (has_emb + has_head))
    return x


def stage_features(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, stage: int, per_layer: dict | None = None
) -> dict[str, float]:
    """Ideal seconds of each kind of work for one micro-batch (forward + backward) on one stage:
    its layers (layer_features, passed in when known) and stage_extras."""
    layers = item_split(shape.layers, lay.pp)[stage][1]
    per_layer = per_layer or layer_features(shape, lay, wl, prof)
    x = {k: layers * v for k, v in per_layer.items()}
    for k, v in stage_extras(shape, lay, wl, prof, stage).items():
        x[k] += v
    return x


def dot(theta: dict, x: dict) -> float:
    return sum(theta[k] * v for k, v in x.items() if v)


def theta_from_profile(prof: Profile) -> dict[str, float]:
    """Inverse efficiencies (seconds per ideal second), seconds per launch for 'launch_us', and
    seconds per step per unit of allocator pressure ('alloc_pressure_s': the profile's calibrated
    value, else the prior ALLOC_PRESSURE_S)."""
    theta = {k: (prof.eff(k) if k == "launch_us" else 1.0 / prof.eff(k)) for k in EFFICIENCY_KEYS}
    theta["alloc_pressure_s"] = float(prof.calibrated.get("alloc_pressure_s", ALLOC_PRESSURE_S))
    return theta
