"""The plan's own kernels where a tool names them many-to-one, so that export -> import gives them back.

torchtitan's attn_backend "varlen" stands for flash2, sdpa, sdpa_flash and sdpa_cudnn alike, and a
ds_config names no kernel at all (the model code chooses). `plan --export` still writes the tool's own
setting, and beside it the plan's exact values where the tool ignores them: a `# harness: attention=...
rmsnorm=...` comment in a torchtitan recipe, a top-level "harness" object in a ds_config (DeepSpeed 0.19.8's
DeepSpeedConfig accepts an unknown top-level key; its sections forbid one). `harness import` takes the exact
value only where it is a kernel the tool's setting stands for; otherwise the tool's wins, said in one line.
Megatron-LM's arguments have no such place: the file is pretrain_gpt.py's argument list, parsed strictly.
"""

from __future__ import annotations

import re

from harness.spec.schema import ATTENTION_KERNELS, RMSNORM_KERNELS

PREFIX = "# harness:"
CHOICES = {"attention": ATTENTION_KERNELS, "rmsnorm": RMSNORM_KERNELS}


def comment(**values: str) -> str:
    """The comment line that carries the plan's exact values (`# harness: attention=sdpa rmsnorm=torch`)."""
    return PREFIX + "".join(f" {k}={v}" for k, v in values.items())


def read_comment(text: str) -> dict[str, str]:
    """The values of a `# harness:` comment line in `text` (the last such line), {} where it has none."""
    lines = [line.strip()[len(PREFIX) :] for line in text.splitlines() if line.strip().startswith(PREFIX)]
    if not lines:
        return {}
    return dict(re.findall(r"([a-z_0-9]+)=(\S+)", lines[-1]))


def choose(field: str, exact, tool: str, stands_for, where: str, lost: list[str]) -> str:
    """The plan's exact value where the export wrote one that the tool's setting stands for, else the tool's
    (with one line saying so)."""
    if exact is None or exact == tool:
        return tool
    if exact in CHOICES.get(field, ()) and exact in stands_for:
        return exact
    why = (
        f"not a {field} kernel of the harness ({', '.join(CHOICES.get(field, ()))})"
        if exact not in CHOICES.get(field, ())
        else f"the tool's setting ({where}) does not run it"
    )
    lost.append(f"{where}: the file's harness {field}={exact} not taken: {why}; written as {tool}")
    return tool
