"""Runs one pipeline rank's instruction list (schedules.program) for one step.

Sends are non-blocking (isend, waited for at STEP); a receive blocks. Each directed pair of
ranks is a FIFO: when the message a RECV wants is not the next one the peer sent, the
executor receives the earlier ones first and keeps them (the peer's send order is known from
its own program), so no tags are needed and the order is exactly the simulator's. A chunk
that hands over to a chunk on the same rank (pp=1 with virtual stages) passes the tensor
directly. All transfers are [seq(/tp under SP), micro_batch, hidden] fp32 activations or
their gradients.
"""

from __future__ import annotations

import time

import torch

from harness.engine.comm import Axis, StepClock
from harness.engine.schedules import Action, _label, send_order


class PipelineExecutor:
    def __init__(self, chunks, programs: list[list[Action]], pp_axis: Axis, clock: StepClock,
                 act_shape: tuple[int, ...], device, autocast):
        self.chunks = chunks
        self.pp = len(programs)
        self.me = pp_axis.index if pp_axis is not None else 0
        self.program = programs[self.me]
        self.axis = pp_axis
        self.clock = clock
        self.act_shape, self.device, self.autocast = act_shape, device, autocast
        self.n_chunks = len(chunks)
        self.last_stage = self.pp * self.n_chunks - 1
        self.peer_order = {p: send_order(programs, p, self.me) for p in range(self.pp)}
        self.timeline: list[dict] = []

    def _recv(self, a: Action):
        want = _label(self.me, a, self.pp)
        buf = self.early.setdefault(a.peer, {})
        while want not in buf:
            if a.peer == self.me:
                raise AssertionError(f"local message {want} was never produced")
            label = self.peer_order[a.peer][self.next_from[a.peer]]
            self.next_from[a.peer] += 1
            t = torch.empty(self.act_shape, dtype=torch.float32, device=self.device)
            buf[label] = self.axis.recv(t, a.peer)
        return buf.pop(want)

    def _send(self, a: Action, t: torch.Tensor):
        t = t.detach().contiguous()
        if a.peer == self.me:
            self.early.setdefault(self.me, {})[_label(self.me, a, self.pp)] = t
            return
        self.pending.append((self.axis.isend(t, a.peer), t))

    def run(self, micro: list[tuple[torch.Tensor, torch.Tensor]], cos, sin, loss_scale: float):
        """Forward and backward every micro-batch; returns this rank's scaled loss sum (0 off the last stage)."""
        self.early: dict[int, dict] = {}
        self.next_from = {p: 0 for p in range(self.pp)}
        self.pending = []
        self.timeline = []
        live: dict[tuple[int, int], tuple] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum = torch.zeros((), device=self.device)
        clock, t_step = self.clock, self.clock.now()
        compute = 0.0
        for a in self.program:
            kind = a.kind
            if kind == "RECV_F" or kind == "RECV_B":
                outputs[(kind, a.chunk, a.micro)] = self._recv(a)
            elif kind == "F":
                stage = a.chunk * self.pp + self.me
                t0 = clock.now()
                inputs, targets = micro[a.micro]
                if stage == 0:
                    x = inputs
                else:
                    x = outputs.pop(("RECV_F", a.chunk, a.micro)).requires_grad_()
                with self.autocast():
                    y = self.chunks[a.chunk](x, cos, sin, targets if stage == self.last_stage else None)
                if stage == self.last_stage:
                    y = y * loss_scale
                    loss_sum += y.detach()
                live[(a.chunk, a.micro)] = (x, y)
                t1 = clock.now()
                compute += t1 - t0
                self.timeline.append({"stage": stage, "kind": "F", "micro": a.micro,
                                      "start_s": t0 - t_step, "end_s": t1 - t_step})
            elif kind == "SEND_F":
                self._send(a, live[(a.chunk, a.micro)][1])
            elif kind == "B":
                stage = a.chunk * self.pp + self.me
                t0 = clock.now()
                x, y = live.pop((a.chunk, a.micro))
                if stage == self.last_stage:
                    y.backward()
                else:
                    torch.autograd.backward(y, outputs.pop(("RECV_B", a.chunk, a.micro)))
                if stage > 0:
                    outputs[("GRAD", a.chunk, a.micro)] = x.grad
                del x, y
                t1 = clock.now()
                compute += t1 - t0
                self.timeline.append({"stage": stage, "kind": "B", "micro": a.micro,
                                      "start_s": t0 - t_step, "end_s": t1 - t_step})
            elif kind == "SEND_B":
                self._send(a, outputs.pop(("GRAD", a.chunk, a.micro)))
            elif kind == "STEP":
                t0 = clock.now()
                for work, _ in self.pending:
                    work.wait()
                clock.seconds["bubble"] += clock.now() - t0
                self.pending = []
        clock.seconds["fb"] += compute
        return loss_sum
