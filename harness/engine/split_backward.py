"""A stage's backward in two parts (zero-bubble schedules): the input gradient now, the weight gradients later.

backward_input is torch.distributed.pipelining's stage_backward_input (what its zero-bubble schedules
run for an I action): autograd.grad from the stage's output to its input only, retaining the graph; pre-hooks
keep, per group of parameters, the gradients reaching the nodes where the parameters' branches join the
input's path (torch's get_param_groups). backward_weight then differentiates from those saved gradients
into the parameters. It differs from torch's stage_backward_weight in one respect, on purpose: it calls
torch.autograd.backward(..., inputs=parameters), so the gradients accumulate through each parameter's
AccumulateGrad node and its post-accumulate hooks fire (the own engine's gradient buckets count and reduce
there, and write into their flat buffers); torch's version assigns .grad by hand. As torch's, where a group
has several junction nodes, each one's incoming gradient is clamped to the saved one, so a gradient flowing
from one junction into another is not counted twice.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


def backward_input(y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: list) -> list[dict]:
    """The input gradient (into x.grad) and what backward_weight needs (torch's param groups)."""
    _, groups = stage_backward_input([y], None if grad is None else [grad], [x], iter(params))
    return groups


def backward_weight(groups: list[dict], params: list) -> None:
    """The weight gradients, accumulated into the parameters' .grad by autograd."""
    by_node = {_get_grad_fn_or_grad_acc(p): p for p in params}
    for group in groups:
        edges, grads = [], []
        kept = group.get("grads") or [()] * len(group["intermediates"])  # none: no gradient reached them
        for saved, node in zip(kept, group["intermediates"], strict=True):
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = []
        if len(group["intermediates"]) > 1:
            handles = [
                node.register_prehook(lambda _grads, saved=saved: saved)
                for saved, node in zip(kept, group["intermediates"], strict=True)
            ]
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=[by_node[n] for n in group["params"]])
        finally:
            for h in handles:
                h.remove()
        group.clear()  # the graph's nodes and saved gradients go with it
