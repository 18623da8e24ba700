"""The single-device reference: the plain model, AdamW, gradient accumulation, clipping.

Every parallel layout and every framework is checked against this engine's losses and weights.
"""

from __future__ import annotations

import torch

from harness.data.source import micro_batches
from harness.model.llama import build_model, lm_loss
from harness.model.training import autocast_for, make_adamw


class SingleDeviceEngine:
    name = "single"

    def __init__(self, spec, shape, device):
        w, lay = spec.workload, spec.layout
        self.spec, self.device = spec, device
        self.model = build_model(shape, w.seed, lay.attention, lay.rmsnorm, lay.activation_checkpointing,
                                 device=device)
        fused = device.type == "cuda"
        self.optimizer = make_adamw(self.model.parameters(), w, fused=fused)

    def train_step(self, global_batch: torch.Tensor) -> float:
        w = self.spec.workload
        micro = micro_batches(global_batch.to(self.device, non_blocking=True), self.spec.layout.micro_batch_size)
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro:
            with autocast_for(w, self.device):
                logits = self.model(inputs)
            loss = lm_loss(logits, targets) / len(micro)
            loss.backward()
            total += loss.detach()
        if w.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), w.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

    def full_state_dict(self):
        return {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}

    def last_step_details(self) -> dict:
        return {}

    def describe(self) -> dict:
        return {"optimizer": "torch.optim.AdamW" + (" (fused)" if self.device.type == "cuda" else " (foreach)")}


def build(spec, shape, ctx):
    if ctx.world_size != 1:
        from harness.errors import SpecError

        raise SpecError("layout.engine", "single runs in one process; use own, deepspeed or fsdp for more")
    return SingleDeviceEngine(spec, shape, ctx.device)
