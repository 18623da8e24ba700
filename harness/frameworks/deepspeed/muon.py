"""Muon under DeepSpeed (workload.optimizer.name: muon; engine deepspeed, ZeRO-1, precision bf16): DeepSpeed
0.19.8's own MuonWithAuxAdam (deepspeed/runtime/zero/muon/muon_optimizer.py) handed to deepspeed.initialize
as the client optimizer, over the harness's split and with the workload's hyperparameters.

Why a client optimizer, not the config's `"type": "Muon"`: under that type deepspeed.initialize's
set_optimizer_flags (deepspeed/__init__.py:357-372) tags every parameter's use_muon by its name, Muon for
every 2-D one whose name lacks "embed" and "lm_head": the harness model's LM head (output.weight) too, which
the workload's policy (harness/model/muon.py, muon_matrix) gives AdamW. Without that type nothing retags;
the harness tags each parameter itself (use_muon = muon_matrix) and builds the two groups DeepSpeed's
_muon_param_groups would (runtime/engine.py: lr, momentum, weight_decay, ns_method for the Muon half; lr,
betas, eps, weight_decay for the AdamW half). ZeRO accepts MuonWithAuxAdam as a supported optimizer
(runtime/zero/utils.py, is_zero_supported_optimizer).

What runs: at ZeRO-1 with bf16 parameters and fp32 gradient accumulation DeepSpeed wraps it in
BF16_Optimizer, whose step clips the fp32 gradients by their global norm and then, per Muon matrix,
exchanges the pieces of a matrix split over partitions (an all-to-all), runs muon_update on the whole
matrix and keeps the momentum as the partition's optimizer state ("momentum_buffer", fp32, the masters'
layout): the reference's order (clip, then Muon). muon_update is torch.optim.Muon's algorithm (momentum
lerp, Nesterov blend, the quintic Newton-Schulz with the same coefficients and 5 steps under ns_method
standard, the update scaled by sqrt(max(1, rows/cols)) as torch's adjust_lr_fn "original", decoupled weight
decay), and the AdamW half is torch.optim.AdamW on CPU, the reference's. Newton-Schulz runs in bf16
(original_muon.py:47, ns_compute_dtype("standard"): bf16 wherever the accelerator supports it), as the
reference's does under the bf16 policy (torch's _zeropower_via_newtonschulz); they differ in where bf16
rounds (DeepSpeed's iteration rounds each product and sum, torch's fuses them into addmm).
"""

from __future__ import annotations

import torch

from harness.model.muon import muon_matrix

NS_METHOD = "standard"  # the quintic iteration torch.optim.Muon runs (DeepSpeed's default "gram" is another)


def muon_optimizer(model: torch.nn.Module, workload):
    """DeepSpeed's MuonWithAuxAdam over `model`'s parameters, each tagged use_muon by the workload's split."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    o = workload.optimizer
    matrices, others = [], []
    for name, p in model.named_parameters():
        p.use_muon = muon_matrix(name, tuple(p.shape))
        (matrices if p.use_muon else others).append(p)
    groups = [
        dict(
            params=matrices,
            use_muon=True,
            lr=o.lr,
            momentum=o.muon_momentum,
            weight_decay=o.weight_decay,
            ns_method=NS_METHOD,
        ),
        dict(params=others, use_muon=False, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay),
    ]
    return MuonWithAuxAdam([g for g in groups if g["params"]], adam_optimizer=torch.optim.AdamW)
