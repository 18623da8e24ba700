"""Runs one pipeline rank's instruction list (schedules.program) for one step.

Two transfer modes, same compute:
  async    sends are isend (waited for at STEP), a receive blocks when its compute needs it.
           Each directed pair of ranks is a FIFO: when the wanted message is not the next one
           the peer sent, the earlier ones are received first and kept (the peer's send order
           is known from its own program), so no tags are needed. Fine for gloo.
  grouped  the transfers between two computes are posted together (batch_isend_irecv), as
           NCCL needs (a lone send to a peer that is itself sending to us can block both);
           schedules.grouped_programs orders them so that no group waits on another forever
           even if each group is waited for as a whole (which NCCL's coalesced work does).
           Where the backend returns one work per transfer (gloo), only the receives are
           waited for at once and the sends at STEP. The default on NCCL; layout.pipeline_p2p:
           grouped forces it elsewhere (the gloo tests run it too).
A chunk that hands over to a chunk on the same rank (pp=1 with virtual stages, the turn of a V)
passes the tensor directly.

Split backward (zbv): B runs torch.distributed.pipelining's stage_backward_input: autograd.grad to
the stage's input only (retaining the graph), with pre-hooks keeping the gradients that reach the
nodes where weight branches join the input's path; W (split_backward.backward_weight) later runs
autograd from those saved gradients into the parameters, so it computes the weight branches only and
accumulates through AccumulateGrad (the gradient buckets' hooks fire as for a whole backward). The
first stage has no input gradient to compute: its B is empty and its W the whole backward (as torch's
stages do). All transfers are [seq(/cp)(/tp under SP), micro_batch, hidden] activations or
their gradients, in the activation dtype (the parameters' dtype of the precision policy: bf16
under precision bf16, as Megatron sends them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.engine.comm import Axis, StepClock
from harness.engine.schedules import Action, Placement, grouped_programs, send_order, transfer_label
from harness.engine.split_backward import backward_input, backward_weight
from harness.model.training import StepHooks


class PipelineExecutor:
    def __init__(
        self,
        chunks,
        programs: list[list[Action]],
        pp_axis: Axis,
        clock: StepClock,
        act_shape: tuple[int, ...],
        device,
        act_dtype: torch.dtype,
        mode: str = "async",
        hooks: StepHooks | None = None,
        batch_isend_irecv=dist.batch_isend_irecv,
        placement: Placement | None = None,
    ):
        self.chunks = chunks
        self.pp = len(programs)
        self.me = pp_axis.index
        self.program = programs[self.me]
        self.axis = pp_axis
        self.clock = clock
        self.act_shape, self.device, self.act_dtype = act_shape, device, act_dtype
        self.n_chunks = len(chunks)
        self.place = placement or Placement(self.pp, self.n_chunks)
        self.last_stage = self.place.last
        self.mode = mode if self.pp > 1 else "async"
        self.peer_order = {p: send_order(programs, p, self.me) for p in range(self.pp)}
        self.grouped = grouped_programs(programs)[self.me] if self.mode == "grouped" else None
        self.marks: list[tuple] = []
        self.split = {(a.chunk, a.micro) for a in self.program if a.kind == "W"}
        self.hooks = hooks or StepHooks()
        self.batch_isend_irecv = batch_isend_irecv  # posts one group (NCCL: one coalesced work)

    # ---------------------------------------------------------------- transfers

    def _buffer(self):
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)

    def _recv(self, a: Action):
        """Async mode: the wanted message, draining the peer's earlier ones into the buffer."""
        want = transfer_label(a)
        buf = self.early.setdefault(a.peer, {})
        while want not in buf:
            if a.peer == self.me or self.mode == "grouped":
                raise AssertionError(f"message {want} from {a.peer} never arrived")
            label = self.peer_order[a.peer][self.next_from[a.peer]]
            self.next_from[a.peer] += 1
            buf[label] = self.axis.recv(self._buffer(), a.peer)
        return buf.pop(want)

    def _send(self, a: Action, t: torch.Tensor):
        t = t.detach().contiguous()
        label = transfer_label(a)
        if a.peer == self.me:
            self.early.setdefault(self.me, {})[label] = t
        elif self.mode == "grouped":
            self.outbox[label] = t
        else:
            self.pending.append((self.axis.isend(t, a.peer), t))

    def _group(self, transfers) -> None:
        """Grouped mode: post a group's sends and receives at once (Axis.exchange), wait for all of them."""
        posted = []
        for t in transfers:
            if t.op == "send":
                tensor = self.outbox.pop(t.label)
            else:
                tensor = self._buffer()
                self.early.setdefault(t.peer, {})[t.label] = tensor
            posted.append((t.op, tensor, t.peer))
        t0 = self.clock.mark()
        works = self.axis.exchange(posted, post=self.batch_isend_irecv)
        if len(works) == len(posted):  # one work per op (gloo): only the receives are needed now
            for (op, tensor, _), work in zip(posted, works, strict=True):
                if op == "recv":
                    work.wait()
                else:
                    self.pending.append((work, tensor))
        else:  # one coalesced work for the group (NCCL)
            for work in works:
                work.wait()
        self.clock.add(self.axis.time_key, t0, self.clock.mark())

    # ---------------------------------------------------------------- compute

    def _forward(self, a: Action, micro, cos, sin, loss_scale):
        self.hooks.forward(f"forward chunk {a.chunk} micro-batch {a.micro}")
        stage = self.place.stage(self.me, a.chunk)
        inputs, targets = micro[a.micro]
        if stage == 0:
            x = inputs
        else:
            x = self._recv(Action("RECV_F", a.chunk, a.micro, self.place.rank(stage - 1), stage)).requires_grad_()
        t0 = self.clock.mark()  # after the receive: its wait is pipeline time, not compute
        y = self.chunks[a.chunk](x, cos, sin, targets if stage == self.last_stage else None)
        if stage == self.last_stage:
            y = y * loss_scale
            self.loss_sum += y.detach()
        self.live[(a.chunk, a.micro)] = (x, y)
        self._mark(stage, "F", a.micro, t0)
        if stage < self.last_stage:
            self._send(Action("SEND_F", a.chunk, a.micro, self.place.rank(stage + 1), stage), y)
        self.hooks.forward_end()

    def _backward(self, a: Action):
        """B: the whole backward, or (split) the input gradient only, W following later."""
        self.hooks.backward(f"backward chunk {a.chunk} micro-batch {a.micro}")
        stage = self.place.stage(self.me, a.chunk)
        item = (a.chunk, a.micro)
        x, y = self.live.pop(item)
        grad = (
            None
            if stage == self.last_stage
            else self._recv(Action("RECV_B", a.chunk, a.micro, self.place.rank(stage + 1), stage))
        )
        t0 = self.clock.mark()
        if item not in self.split:
            torch.autograd.backward(y, grad)
        elif stage == 0:  # no input gradient: W does the whole backward
            self.deferred[item] = (y, grad)
        else:
            self.deferred[item] = backward_input(y, grad, x, list(self.chunks[a.chunk].parameters()))
        self._mark(stage, "B", a.micro, t0)
        if stage > 0:
            self._send(Action("SEND_B", a.chunk, a.micro, self.place.rank(stage - 1), stage), x.grad)

    def _weight(self, a: Action):
        """W: the weight gradients of a split backward."""
        self.hooks.backward(f"weight gradients chunk {a.chunk} micro-batch {a.micro}")
        stage = self.place.stage(self.me, a.chunk)
        t0 = self.clock.mark()
        saved = self.deferred.pop((a.chunk, a.micro))
        if stage == 0:
            torch.autograd.backward(*saved)
        else:
            backward_weight(saved, list(self.chunks[a.chunk].parameters()))
        self._mark(stage, "W", a.micro, t0)

    def _mark(self, stage, kind, micro, t0):
        t1 = self.clock.mark()
        self.clock.add("fb", t0, t1)
        self.marks.append((stage, kind, micro, t0, t1))

    def resolve_timeline(self) -> list[dict]:
        """The step's forwards and backwards in seconds from the step's start (after clock.finish())."""
        el = self.clock.elapsed
        return [
            {"stage": st, "kind": k, "micro": m, "start_s": el(self.t_step, a), "end_s": el(self.t_step, b)}
            for st, k, m, a, b in self.marks
        ]

    # ---------------------------------------------------------------- step

    def run(self, micro: list[tuple[torch.Tensor, torch.Tensor]], cos, sin, loss_scale: float):
        """Forward and backward every micro-batch; returns this rank's scaled loss sum (0 off the last stage)."""
        self.early: dict[int, dict] = {}
        self.next_from = {p: 0 for p in range(self.pp)}
        self.pending, self.outbox, self.live, self.deferred = [], {}, {}, {}
        self.marks = []
        self.loss_sum = torch.zeros((), device=self.device)
        self.t_step = self.clock.mark()
        items = self.grouped if self.mode == "grouped" else self.program
        for a in items:
            if isinstance(a, list):
                self._group(a)
            elif a.kind == "F":
                self._forward(a, micro, cos, sin, loss_scale)
            elif a.kind == "B":
                self._backward(a)
            elif a.kind == "W":
                self._weight(a)
            elif a.kind == "STEP":
                t0 = self.clock.mark()
                for work, _ in self.pending:
                    work.wait()
                self.clock.add(self.axis.time_key, t0, self.clock.mark())
                self.pending = []
            # RECV_* / SEND_* of the async program: done inside _forward/_backward
        return self.loss_sum
