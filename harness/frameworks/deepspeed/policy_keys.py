"""The keys of a DeepSpeed 0.19.8 config that would change the precision policy, refused before launch.

Every engine of a comparison runs the workload's policy (harness/model/training.py, PrecisionPolicy):
the parameters computed with in the workload's precision, fp32 master weights and Adam states,
gradients accumulated and reduced in the workload's dtypes. config.py fills the keys that express
it (bf16.enabled, data_types.grad_accum_dtype/param_dtype, communication_data_type, ...). These are
DeepSpeed's other keys that change a dtype of parameters, gradients, masters, optimizer states or
collectives (read from runtime/config.py, precision_config.py, engine.py, zero/config.py):
a config that sets one is refused, naming the key, rather than run under another policy.
"""

from __future__ import annotations

AUTO = "auto"

# key -> what it does when true (DeepSpeed's default is false for each)
SWITCHES = {
    "bf16.bf16_master_weights_and_grads": "keeps the master weights and their gradients in bf16 (the workload's: fp32)",
    "bf16.bf16_optimizer_states": "keeps Adam's states in bf16 (the workload's: fp32)",
    "fp16.enabled": "trains in fp16, which no workload precision offers",
    "fp16.auto_cast": "casts the model's inputs to fp16",
    "fp16.fp16_master_weights_and_grads": "keeps the master weights and their gradients in fp16",
    "torch_autocast.enabled": "computes under torch.autocast (the workload's precision decides the compute "
    "dtype: bf16.enabled)",
    "zero_optimization.zero_quantized_weights": "quantizes the parameters ZeRO-3 gathers",
    "zero_optimization.zero_quantized_nontrainable_weights": "stores frozen parameters quantized",
    "zero_optimization.zero_quantized_gradients": "quantizes the gradients ZeRO reduces",
}

# sections refused whole: what they change
SECTIONS = {
    "amp": "NVIDIA apex AMP: its own casts and loss scaling; the workload's precision decides bf16",
    "bfloat16": "DeepSpeed's old name of the bf16 section, read only where bf16 is absent (the harness "
    "writes bf16): move its keys under bf16",
    "weight_quantization": "quantizes the weights",
    "zero_optimization.zenflow": "ZenFlow applies the less important gradient columns only every "
    "update_interval steps (asynchronously), not the workload's AdamW update every step; it also hands "
    "optimizer.params verbatim to torch's AdamW",
}


def _get(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set_false(cfg: dict, dotted: str) -> None:
    *parents, key = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[key] = False


def policy_switches(f, cfg: dict) -> None:
    """Refuse (f.refuse: collected, raised with the config's other contradictions) every key that
    would run another precision policy; "auto" on a switch means false and is filled."""
    for dotted, what in SWITCHES.items():
        value = _get(cfg, dotted)
        if value == AUTO:
            _set_false(cfg, dotted)
            f.filled.append(dotted)
        elif value not in (None, False):
            f.refuse(dotted, f"{value!r} {what}; remove it or set false")
    for dotted, what in SECTIONS.items():
        if _get(cfg, dotted) is not None:
            f.refuse(dotted, f"not supported: {what}; remove the section")
    buffers = _get(cfg, "data_types.buffer_dtype")
    if buffers is not None and str(buffers).lower() not in ("fp32", "float32", "float", "torch.float32"):
        f.refuse(
            "data_types.buffer_dtype",
            f"{buffers!r} casts the model's buffers (rotary tables) away from fp32, as no other engine does; remove it",
        )
    states = _get(cfg, "optimizer.params.fp32_optimizer_states")
    if states is not None and states is not True:
        f.refuse(
            "optimizer.params.fp32_optimizer_states",
            f"{states!r} keeps CPU Adam's states in the parameters' dtype (the workload's: fp32); "
            "remove it or set true",
        )
