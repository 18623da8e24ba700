"""What each rank does: build, train, time, and write the record.

Success is judged from the record, not from the exit code: a rank that raises writes a
failure record (status oom for an out-of-memory error) under the same run_id before it exits.
A run whose loss becomes non-finite stops at that step and is recorded failed (Diverged), with
the step, never as a measurement.
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch

from harness import gather, profiling, registry
from harness.data.source import token_source
from harness.errors import NonFiniteStep
from harness.frameworks import build_engine
from harness.measure.census import SavedActivations
from harness.measure.fingerprint import fingerprint
from harness.measure.memory import peak_memory, reset_peak_memory
from harness.measure.mfu import datasheet_peak_tflops, measure_matmul_tflops, mfu_table
from harness.measure.stats import summarize
from harness.measure.stream import MetricsStream
from harness.measure.timers import StepTimer
from harness.measure.turns import Turns
from harness.measure.weights import MAX_PARAMETERS, weights_fingerprint
from harness.model.compiled import CompileWatch
from harness.model.flops import flops_per_token
from harness.model.kernels import attention_backend_name, rmsnorm_backend_name, run_kernels
from harness.model.moe import router_record
from harness.model.presets import active_param_count, param_count
from harness.model.training import precision_policy
from harness.parallel_dims import ParallelDims
from harness.profiling import record as profile_record
from harness.profiling import trace as profile_trace
from harness.profiling.analysis import breakdown as trace_breakdown
from harness.profiling.counters import MeasuredSteps
from harness.progress import Progress
from harness.runtime import RunContext
from harness.spec import RunSpec, check_world_size, layout_label, micro_batches_per_step
from harness.store import ResultsStore, mentions_oom, mentions_peer_failure, new_record, now_iso


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or mentions_oom(str(exc))


def _fault(step: int, rank: int) -> bool:
    """Test-only fault hook: HARNESS_FAULT=kill|hang|oom|raise|nan:STEP[:RANK]; True for nan (the
    step's loss is to become NaN, as a diverging run's does)."""
    fault = os.environ.get("HARNESS_FAULT")
    if not fault:
        return False
    kind, at, *who = fault.split(":")
    if int(at) != step or (who and int(who[0]) != rank):
        return False
    if kind == "nan":
        return True
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "oom":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by HARNESS_FAULT)")
    raise RuntimeError(f"fault injected by HARNESS_FAULT at step {step}")


class Diverged(Exception):
    """The loss became non-finite: the run stops there and is recorded failed, never as a
    measurement. Every engine returns the global mean loss on every rank (the parity check
    compares it), so every rank stops at the same step, with no extra collective."""

    def __init__(self, step: int, loss: float, total: int, losses: list[float], cause: str | None = None):
        what = cause or f"the loss became {loss}"
        super().__init__(
            f"diverged: {what} at step {step} of {total} (warm-up included), so the run stopped "
            "there; a learning rate too high (workload.optimizer.lr) is the usual cause"
        )
        self.step, self.loss, self.losses = step, loss, list(losses)


def preflight(spec: RunSpec, ctx: RunContext):
    """Every check that needs the machine, before anything is built: world, kernels (the spec's
    own checks ran when it was parsed)."""
    shape = spec.shape()
    check_world_size(spec, ctx.world_size)
    engine = registry.facts(spec.layout.engine)
    if engine.preflight is not None:  # e.g. a ds_config that contradicts the workload
        engine.preflight(spec)
    run_kernels(spec, ctx.device)  # the same check compare and sweep make before they launch (check_machine)
    return shape


class Trainer:
    """The measured loop, one step at a time (benchmarks interleave it with other loops)."""

    def __init__(
        self,
        spec: RunSpec,
        ctx: RunContext,
        shape,
        *,
        peak_tflops: float | None = None,
        progress: bool = True,
        tensorboard_dir: str | None = None,
    ):
        w, lay = spec.workload, spec.layout
        self.spec, self.ctx = spec, ctx
        self.dims = ParallelDims.of(lay)
        self.engine = build_engine(spec, shape, ctx)
        self.compiled = CompileWatch(lay.compile)  # compile time apart; a recompilation after warm-up fails the run
        self.data = token_source(w, shape.vocab)
        self.total = w.warmup_steps + w.steps
        self.tokens_per_step = w.global_batch_size * w.seq_len
        self.fpt = flops_per_token(shape, w.seq_len, lay.activation_checkpointing)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        self.peak, self.peak_source = peak_tflops, "override" if peak_tflops else None
        if self.peak is None and ctx.device.type == "cuda":
            self.peak = datasheet_peak_tflops(device_name)
            self.peak_source = f"datasheet dense bf16 ({device_name})" if self.peak else None
        self.bar = Progress(progress and ctx.is_main, self.total)
        # rank 0's per-step metrics to TensorBoard (`--tensorboard DIR`), written as the run goes
        self.stream = MetricsStream(tensorboard_dir, layout_label(lay)) if tensorboard_dir and ctx.is_main else None
        self.losses, self.times, self.details = [], [], []  # every step's loss; the measured steps' times, details
        self.grad_norms: list[float | None] = []  # every step's global gradient norm before clipping (parity)
        self.weights: dict | str | None = None  # the final weights' fingerprint, or why none (fingerprint_weights)
        self.parameter_count, self.micro = param_count(shape), micro_batches_per_step(spec)
        self.activations_saved_bytes: int | None = None
        self.routed, self.router, self.active = shape.moe, [], active_param_count(shape)
        self.profile: dict | None = None
        self.memory_before_profile: tuple | None = None
        # the measured steps' breakdown
        self.clocks = MeasuredSteps(self.dims, ctx.rank, self.engine.process_groups(), ctx.device.type)

    def _train_step(self, step: int, batch) -> float:
        """The engine's step and its loss's value; the first one also counts the activations
        saved for backward."""
        if step:
            return float(self.engine.train_step(batch))
        with SavedActivations(self.engine.activation_exclusions()) as saved:
            loss = self.engine.train_step(batch)
        self.activations_saved_bytes = saved.bytes // self.micro  # per micro-batch
        return float(loss)

    def step(self, step: int) -> float:
        w = self.spec.workload
        batch = self.data.global_batch_at(step)
        if step == w.warmup_steps:
            reset_peak_memory(self.ctx.device)
            self.compiled.arm()
        poisoned = _fault(step, self.ctx.rank)
        cause = None
        with self.clocks.clock(step >= w.warmup_steps), StepTimer(self.ctx.device) as timer:
            try:
                loss = self._train_step(step, batch)
            except NonFiniteStep as e:  # the framework refused the update (every rank sees the same global norm):
                cause = str(e)  # the step did not complete, so it has no loss to record
        self.clocks.add(timer.seconds)  # a measured step's breakdown (nothing for a warm-up step)
        if self.routed:  # a MoE's routing this step (harness.model.moe), whatever the engine
            self.router.append(self.engine.router_stats())
        if cause:
            raise Diverged(step + 1, math.nan, self.total, self.losses, cause)
        loss = math.nan if poisoned else loss
        self.losses.append(loss)
        self.grad_norms.append(self.engine.grad_norm())
        if not math.isfinite(loss):
            raise Diverged(step + 1, loss, self.total, self.losses)
        if step >= w.warmup_steps:
            self.times.append(timer.seconds)
            self.details.append(self.engine.last_step_details())
        mfu = self.peak and self.fpt["palm"] * self.tokens_per_step / timer.seconds / (
            self.ctx.world_size * self.peak * 1e12
        )
        self.bar.update(step, timer.seconds, self.tokens_per_step, loss, mfu, force=step == self.total - 1)
        if self.stream is not None:
            self.stream.step(
                step, loss=loss, seconds=timer.seconds, tokens=self.tokens_per_step, mfu=mfu, device=self.ctx.device
            )
        return timer.seconds

    def fingerprint_weights(self) -> None:
        """The final weights' fingerprint (harness.measure.weights), gathered on rank 0 by the engine's
        full_state_dict (a collective: every rank calls it); above MAX_PARAMETERS none, said why."""
        if self.parameter_count > MAX_PARAMETERS:
            self.weights = f"not gathered: {self.parameter_count:,} parameters (> {MAX_PARAMETERS:,}) on one rank"
            return
        self.memory_before_profile = peak_memory(self.ctx.device)  # the gathered copy is not the run's either
        state = self.engine.full_state_dict()
        self.weights = weights_fingerprint(state) if state is not None else None

    def profile_steps(self, steps: int) -> None:
        """`steps` extra steps under the profiler after the measured ones: no step-time statistic
        and no loss list counts them. The engine's own counters (where it keeps them) over the
        same steps are kept beside the trace's breakdown, as its reference."""
        if steps <= 0:
            return
        # the profiler's buffers are not the run's (taken before the weights' gather where there was one)
        self.memory_before_profile = self.memory_before_profile or peak_memory(self.ctx.device)
        started = time.perf_counter()
        instrumented: list[dict] = []

        def one(i: int) -> None:
            self.engine.train_step(self.data.global_batch_at(self.total + i))
            if self.engine.times_own_communication:  # its counters over the same steps (the own engine)
                instrumented.append(self.engine.last_step_details()["breakdown_s"])

        try:
            trace = profile_trace.record(one, steps, self.dims, self.ctx.rank, self.ctx.device, self.clocks.axis_of)
        except NonFiniteStep as e:  # every rank refuses the same update: the measurement stands, no breakdown
            self.profile = {"trace": None, "analysis": None, "instrumented": None, "error": f"profiled step: {e}"}
            return
        self.profile = {"trace": trace, "instrumented": instrumented if len(instrumented) == steps else None}
        try:
            self.profile["analysis"] = trace_breakdown(trace, self.ctx.device.type, self.dims.pp, self.dims)
        except (ValueError, KeyError) as e:  # a trace the analysis cannot read: said in the record
            self.profile.update(analysis=None, error=f"{type(e).__name__}: {e}")
        self.profile["wall_s"] = time.perf_counter() - started  # what profiling adds: steps, export, analysis

    def close_stream(self) -> None:
        self.compiled.close()
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def metrics(self, measure_matmul: bool = True, trace_dir: str | None = None, trace_name: str = "run") -> dict:
        """Summaries over the measured steps (the same dict on every rank); the profiled steps'
        breakdown and collectives, and their trace files' entries under "traces"."""
        self.bar.close()
        ctx, w, lay = self.ctx, self.spec.workload, self.spec.layout
        times = gather.max_across_ranks(self.times, ctx)  # a step lasts until its slowest rank finishes
        mem, mem_kind = self.memory_before_profile or peak_memory(ctx.device)
        mem_all = gather.max_across_ranks([float(mem)], ctx)[0]
        stats = summarize(times)
        tokens_per_s = self.tokens_per_step / stats["median"]
        dtype = precision_policy(w).peak_matmul_dtype  # fp8: bf16, the dtype its parameters compute in
        measured_peak = measure_matmul_tflops(ctx.device, dtype) if measure_matmul else None
        fpt = self.fpt
        metrics = {
            "step_time_s": stats,
            "step_times_s": times,
            "losses": self.losses,
            "grad_norms": self.grad_norms if any(g is not None for g in self.grad_norms) else None,
            # rank 0's (the others' None): {name: [norm, projection]}, or why none was taken
            "weights_fingerprint": self.weights,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / ctx.world_size,
            "flops_per_token": fpt,
            "achieved_tflops_per_device": {k: v * tokens_per_s / ctx.world_size / 1e12 for k, v in fpt.items()},
            "peak_tflops": self.peak,
            "peak_tflops_source": self.peak_source,
            "mfu": mfu_table(fpt, tokens_per_s, ctx.world_size, self.peak),
            "measured_matmul_tflops": measured_peak,
            "mfu_vs_measured_matmul": mfu_table(fpt, tokens_per_s, ctx.world_size, measured_peak),
            "peak_memory_bytes": int(mem_all),
            "memory_kind": mem_kind,
            "rmsnorm_backend": rmsnorm_backend_name(lay.rmsnorm, ctx.device.type),
            "attention_backend": attention_backend_name(lay.attention, ctx.device, self.spec.shape(), w.seq_len, dtype),
            "engine": self.engine.describe(),
            "parameter_count": self.parameter_count,
        }
        metrics.update(gather.census_over_ranks(self.engine, self.activations_saved_bytes, ctx))
        metrics.update(_summarize_details(self.details))
        metrics.update(self.compiled.metrics(lambda values: gather.max_across_ranks(values, ctx)))
        if self.routed:  # MFU's FLOPs count the experts a token passes through (harness/model/flops.py)
            metrics["router"] = router_record(gather.router_over_ranks(self.router, ctx), w.warmup_steps)
            metrics["active_parameter_count"] = self.active
        if metrics.get("pipeline_timeline") is not None:
            metrics["pipeline_timeline"] = gather.timeline_of_every_stage(metrics["pipeline_timeline"], ctx)
        if metrics.get("breakdown_s") is not None:
            metrics.update(gather.breakdown_over_ranks(metrics["breakdown_s"], ctx))
        profiled, traces = profile_record.profile_metrics(self.profile, ctx, trace_dir, trace_name)
        metrics.update(profiled)
        metrics.update(profile_record.measured_metrics(self.clocks.counted, times, self.clocks.calls, ctx))
        # no profiler breakdown (profiling off, or its trace unreadable): the engine's own counters, where it keeps them
        if "breakdown_ms" not in profiled and self.engine.times_own_communication:
            metrics.update(
                breakdown_ms=profile_record.from_instrumented(metrics["breakdown_s"], self.dims.pp),
                breakdown_ms_by_rank=[profile_record.from_instrumented(r) for r in metrics["breakdown_s_by_rank"]],
                breakdown_source="instrumented",
            )
        if traces:
            metrics["traces"] = traces
        return metrics


def train(
    spec: RunSpec,
    ctx: RunContext,
    shape,
    *,
    peak_tflops: float | None = None,
    measure_matmul: bool = True,
    progress: bool = True,
    tensorboard_dir: str | None = None,
    profile_steps: int = 0,
    trace_dir: str | None = None,
    trace_name: str = "run",
) -> dict:
    """Run warm-up plus measured steps, then `profile_steps` profiled ones; return the metrics
    (the same dict on every rank; the trace files' entries under metrics["traces"])."""
    trainer = Trainer(spec, ctx, shape, peak_tflops=peak_tflops, progress=progress, tensorboard_dir=tensorboard_dir)
    turns = Turns.from_env(ctx.rank)  # runs interleaved with others (compare --interleave): steps when granted
    try:
        for step in range(trainer.total):
            if turns:
                turns.before(step)
            trainer.step(step)
        if turns:  # what follows runs while no other run measures
            turns.before(trainer.total)
        trainer.fingerprint_weights()  # the trained steps' weights: profiled steps train further
        trainer.profile_steps(profile_steps)
    except Diverged:
        trainer.bar.close()
        raise
    finally:  # the steps so far stay readable in TensorBoard, also when a step failed
        trainer.close_stream()
    return trainer.metrics(measure_matmul, trace_dir, trace_name)


def tensorboard_run_dir(base: str, spec: RunSpec, run_id: str, sweep: str | None) -> str:
    """One TensorBoard run per record: <base>/<sweep or spec name>/<layout label>-<run id prefix>,
    each part a plain file name (TensorBoard names the run after its folder)."""
    import re

    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "run"

    return os.path.join(base, safe(sweep or spec.name or "train"), safe(f"{layout_label(spec.layout)} {run_id[:8]}"))


def _summarize_details(details: list[dict]) -> dict:
    """Per-step breakdowns become their medians (this rank's); comm counts and timeline come
    from the last step."""
    out: dict = {}
    rows = [d["breakdown_s"] for d in details if d and d.get("breakdown_s")]
    if rows:
        out["breakdown_s"] = {k: summarize([r[k] for r in rows])["median"] for k in rows[0]}
    last = details[-1] if details else {}
    for key in ("comm", "pipeline_timeline"):
        if last and last.get(key) is not None:
            out[key] = last[key]
    return out


def run(
    spec: RunSpec,
    ctx: RunContext,
    *,
    store_path: str | None = None,
    run_id: str | None = None,
    sweep: str | None = None,
    point_key: str | None = None,
    peak_tflops: float | None = None,
    progress: bool = True,
    tensorboard_dir: str | None = None,
    profile_steps: int | None = None,
    trace_dir: str | None = None,
) -> dict:
    """Preflight (SpecError propagates: exit 2), train, write the record; failures are recorded.

    `profile_steps` extra steps are profiled after the measured ones (None: the default,
    harness.profiling.default_steps()); rank 0's and the slowest rank's traces are written
    to `trace_dir` (default: harness-traces beside the store; none for an in-memory store) and
    named in record["traces"]."""
    shape = preflight(spec, ctx)
    record = new_record(spec.to_dict(), sweep=sweep, point_key=point_key)
    if run_id:
        record["run_id"] = run_id
    store = ResultsStore(store_path or spec.store)
    record["fingerprint"] = fingerprint(ctx.device, ctx.world_size, gather.hosts(ctx))
    tb_dir = None
    if tensorboard_dir:
        tb_dir = record["tensorboard_dir"] = tensorboard_run_dir(tensorboard_dir, spec, record["run_id"], sweep)
    try:
        profile_steps = profiling.default_steps() if profile_steps is None else profile_steps
        store_file = store_path or spec.store
        if trace_dir is None and store_file != ":memory:":  # an in-memory store keeps no files: nor traces
            trace_dir = os.path.join(os.path.dirname(store_file), "harness-traces")
        metrics = train(
            spec,
            ctx,
            shape,
            peak_tflops=peak_tflops,
            progress=progress,
            tensorboard_dir=tb_dir,
            profile_steps=profile_steps,
            trace_dir=trace_dir,
            trace_name=record["run_id"],
        )
        traces = metrics.pop("traces", None)
        if traces:
            record["traces"] = traces
        record["metrics"] = metrics
        record["status"] = "ok"
    except Diverged as d:  # a result, not a crash: every rank is here, the group ends normally
        record.update(status="failed", error=str(d), diverged_at_step=d.step, metrics={"losses": d.losses})
    except Exception as exc:  # recorded, then re-raised so the launcher sees the failure
        import traceback

        record["status"] = "oom" if is_oom(exc) else "failed"
        record["error"] = f"rank {ctx.rank}: {type(exc).__name__}: {exc}\n" + traceback.format_exc()[-2000:]
        record["ended_at"] = now_iso()
        # which rank failed and whether it is the echo of a peer's failure (a lost connection):
        # the launcher names the rank that died first from these (harness.launch.first_failure)
        record["rank_failures"] = [
            {
                "rank": ctx.rank,
                "status": record["status"],
                "at": record["ended_at"],
                "echo": record["status"] != "oom" and mentions_peer_failure(str(exc)),
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
            }
        ]
        store.write(record, keep_earlier_failure=True)  # a peer's echo must not hide the cause
        raise
    record["ended_at"] = now_iso()
    if ctx.is_main:
        store.write(record)
    return record
