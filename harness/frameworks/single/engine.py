"""The single-device reference: the plain model, AdamW, gradient accumulation, clipping, and
the workload's precision policy (bf16: Megatron-style fp32 master weights and main gradients).

Every parallel layout and every framework is checked against this engine's losses and weights.
"""

from __future__ import annotations

import torch

from harness.data.source import micro_batches
from harness.measure.census import CensusAtStep, optimizer_state_tensors
from harness.model.compiled import compile_blocks
from harness.model.llama import build_model, lm_loss
from harness.model.moe import set_router_losses, take_router_stats
from harness.model.training import MasterWeights, make_adamw, precision_policy
from harness.spec import micro_batches_per_step as spec_micro_batches


class SingleDeviceEngine:
    name = "single"
    times_own_communication = False  # nothing to time: no communication

    def __init__(self, spec, shape, device):
        w, lay = spec.workload, spec.layout
        self.spec, self.device = spec, device
        self._grad_norm = None  # the last step's
        self.policy = precision_policy(w)
        self.model = build_model(shape, w.seed, lay.attention, lay.rmsnorm, lay.activation_checkpointing, device=device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.model.to(self.policy.compute)  # the parameters computed with (buffers too: none hold state)
        self.policy.convert_fp8(self.model, device.type)  # fp8: the linears' GEMMs (same Parameters, same names)
        compile_blocks(self.model.layers.values(), lay.compile)
        set_router_losses(self.model, w.moe_aux_loss_coeff, w.moe_z_loss_coeff, spec_micro_batches(spec))
        self.weights = MasterWeights(list(self.model.parameters()), self.policy)
        self.optimizer = make_adamw(self.weights.optimizer_params(), w, fused=device.type == "cuda")
        self.census = CensusAtStep(self.optimizer, self._census_tensors)

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        w = self.spec.workload
        micro = micro_batches(global_batch.to(self.device, non_blocking=True), self.spec.layout.micro_batch_size)
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro:
            loss = lm_loss(self.model(inputs), targets) / len(micro)
            loss.backward()
            self.weights.after_backward()
            total += loss.detach()
        self.weights.grads_to_masters()
        params = self.weights.optimizer_params()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        self._grad_norm = norm.detach()  # read after the step: no device sync inside it
        if w.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, w.grad_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights.after_step()
        return total

    def full_state_dict(self):
        """The fp32 master weights (the parameters themselves under fp32), named as the model's."""
        return {
            n: t.detach().float().cpu().clone()
            for n, t in zip(self.names, self.weights.optimizer_params(), strict=True)
        }

    def last_step_details(self) -> dict:
        return {}

    def grad_norm(self) -> float | None:
        return None if self._grad_norm is None else float(self._grad_norm)

    def router_stats(self) -> dict:
        """Each MoE layer's routing statistics over the last step (every token is this process's)."""
        return take_router_stats(self.model)

    def _census_tensors(self) -> dict:
        return {**self.weights.census_tensors(), "optimizer_states": optimizer_state_tensors(self.optimizer)}

    def memory_census(self) -> dict | None:
        return self.census.result

    def activation_exclusions(self) -> list:
        return list(self.model.parameters())

    def process_groups(self) -> dict:
        return {}  # no process group

    def describe(self) -> dict:
        return {
            "optimizer": "torch.optim.AdamW" + (" (fused)" if self.device.type == "cuda" else " (foreach)"),
            "precision_policy": self.policy.describe(),
            **({"fp8_backend": self.policy.fp8_backend(self.device.type)} if self.policy.fp8 else {}),
            **({"compile": "torch.compile per block (inductor)"} if self.spec.layout.compile == "blocks" else {}),
        }
