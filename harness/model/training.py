"""What every engine shares around the model: the optimizer and the precision context.

Kept below the engines and adapters so that the own engine, FSDP2 and the reference build the
same AdamW from the workload and run under the same autocast, from one definition.
"""

from __future__ import annotations

import contextlib

import torch


def make_adamw(params, workload, **kw):
    o = workload.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             weight_decay=o.weight_decay, **kw)


def autocast_for(workload, device: torch.device):
    """bf16 mixed precision keeps fp32 weights (the master copy) and runs matmuls in bf16."""
    if workload.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
