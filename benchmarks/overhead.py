"""Runner overhead: the harness's median step time over a minimal hand-written PyTorch loop.

Same process, same model (preset tiny-256: 4 layers, hidden 256), same batch, fp32 on CPU.
The two alternate in rounds so that machine noise hits both alike. Target: ratio <= 1.03.
Profiling is on as in `harness train`: after each round's measured steps the runner profiles its
extra steps (--profile-steps, the default), so every later round's measured steps run after a
profiled stretch, in the same process, as the next run of a sweep would; what the profiled steps
add to a round's wall time is printed. Last line: `ratio: <number>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from harness.data.source import SyntheticTokens
from harness.model.llama import build_model
from harness.model.presets import resolve_shape
from harness.profiling import DEFAULT_STEPS
from harness.run import Trainer
from harness.runtime import RunContext
from harness.spec import parse_spec


class MinimalLoop:
    """What a person would write by hand: model, AdamW, accumulate, clip, step."""

    def __init__(self, shape, spec):
        w = spec.workload
        self.spec = spec
        self.model = build_model(shape, w.seed, spec.layout.attention)
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=w.optimizer.lr,
            betas=w.optimizer.betas,
            eps=w.optimizer.eps,
            weight_decay=w.optimizer.weight_decay,
        )
        self.data = SyntheticTokens(shape.vocab, w.seq_len, w.global_batch_size, w.seed)

    def step(self, step: int) -> float:
        batch = self.data.global_batch_at(step)
        t0 = time.perf_counter()
        chunks = batch.split(self.spec.layout.micro_batch_size)
        for mb in chunks:
            logits = self.model(mb[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten()) / len(chunks)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.workload.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=DEFAULT_STEPS, help="profiled steps after each round")
    args = ap.parse_args()
    spec = parse_spec(
        {
            "workload": {
                "model": "tiny-256",
                "seq_len": 128,
                "global_batch_size": 8,
                "steps": args.steps,
                "warmup_steps": 2,
            },
            "layout": {"engine": "single", "micro_batch_size": 2, "attention": "sdpa"},
            "store": ":memory:",
        }
    )
    shape = resolve_shape("tiny-256")
    ctx = RunContext(0, 1, 0, torch.device("cpu"), None)
    runner, minimal, rounds_s, profiled_s = [], [], [], []
    for r in range(args.rounds):
        started = time.perf_counter()
        # step by step, alternating which goes first, so machine noise hits both alike
        trainer, loop = Trainer(spec, ctx, shape, progress=False), MinimalLoop(shape, spec)
        got, mine = [], []
        for step in range(args.warmup + args.steps):
            order = (trainer, loop) if step % 2 == 0 else (loop, trainer)
            seconds = {id(x): x.step(step) for x in order}
            if step >= args.warmup:
                got.append(seconds[id(trainer)])
                mine.append(seconds[id(loop)])
        runner += got
        minimal += mine
        t0 = time.perf_counter()
        trainer.profile_steps(args.profile_steps)  # what train() does after the measured steps
        if args.profile_steps:
            trainer.metrics(measure_matmul=False)  # the breakdown's assembly (trace files: none here)
        profiled_s.append(time.perf_counter() - t0)
        rounds_s.append(time.perf_counter() - started)
        assert len(trainer.times) == args.steps, "a profiled step was counted as a measured one"
        print(
            f"round {r + 1}: runner median {statistics.median(got) * 1e3:.2f} ms, "
            f"minimal loop median {statistics.median(mine) * 1e3:.2f} ms; "
            f"{args.profile_steps} profiled steps {profiled_s[-1]:.2f} s of the round's {rounds_s[-1]:.2f} s"
        )
    a, b = statistics.median(runner), statistics.median(minimal)
    print(f"runner median {a * 1e3:.2f} ms over {len(runner)} steps; minimal {b * 1e3:.2f} ms over {len(minimal)}")
    print(
        f"profiling added {sum(profiled_s):.2f} s to {sum(rounds_s):.2f} s of rounds "
        f"({100 * sum(profiled_s) / sum(rounds_s):.1f}%; a round also runs the minimal loop)"
    )
    print(f"ratio: {a / b:.3f}")


if __name__ == "__main__":
    main()
