"""Hardware profiles: datasheet peaks and bandwidths plus efficiency constants, as YAML.

Built-in profiles live beside this file (hardware/*.yaml); a user passes a path to their own.
`efficiency` holds literature values; a `calibrated` block (written by `harness plan
--calibrate`) overrides them, so a calibrated profile still says where every number came from.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harness.errors import SpecError
from harness.files.yaml_reader import read_yaml
from harness.planner.layout import ATTENTION

PROFILE_DIR = Path(__file__).with_name("hardware")
EFFICIENCY_KEYS = (
    *"gemm flash3 flash2 flash1 mem_efficient naive_attention fused_softmax hbm nvlink internode launch_us".split(),
    "gemm_fp8",
)
# Literature priors for keys a profile may lack (its own value wins; otherwise a100-80gb.yaml's):
# gemm_fp8, the share of the FP8 peak the linear layers' FP8 GEMMs reach. torchao's roofline
# (torchao/testing/training/roofline_utils.py) assumes one share for bf16 and fp8 GEMMs on H100 (78%,
# "experimental observation with sample large inputs"); at training shapes an FP8 GEMM finishes in
# half a bf16 one's time, so its fixed per-tile costs (prologue, the scaled epilogue) weigh twice and
# the share is lower: the H100 bf16 prior (0.70) x 0.9, an assumption until fitted (calibrate.py).
EFFICIENCY_DEFAULTS = {"gemm_fp8": 0.63}


@dataclass
class Profile:
    name: str
    peak_tflops_bf16: float
    peak_tflops_fp32: float
    memory_gib: float
    hbm_gbps: float
    nvlink_gbps: float
    internode_gbps: float
    gpus_per_node: int
    efficiency: dict[str, float]
    # Largest number of nodes a non-pipelined data-parallel reduction may span and still drive
    # one NIC per group member in a node (timing.py); beyond it the reduction runs as over one NIC.
    rail_aggregation_max_nodes: int = 20
    device_names: list[str] = field(default_factory=list)
    attention_kernels: tuple[str, ...] = ATTENTION
    calibrated: dict = field(default_factory=dict)
    source: str = ""
    # Dense FP8 tensor-core peak (TFLOP/s; profile key peak_tflops_fp8, default 2 x bf16, the
    # datasheet ratio on Hopper and Blackwell) and whether the device has FP8 tensor cores at all
    # (profile key fp8, default true; false on A100 and the CPU: `harness plan --precision fp8` refuses).
    peak_tflops_fp8: float = 0.0
    fp8: bool = True

    def eff(self, key: str) -> float:
        """Calibrated value if there is one, else the literature value."""
        values = self.calibrated.get("efficiency", {})
        return float(values.get(key, self.efficiency[key]))

    def peak_flops(self, dtype_bytes: int) -> float:
        return 1e12 * (self.peak_tflops_bf16 if dtype_bytes == 2 else self.peak_tflops_fp32)

    def peak_flops_fp8(self) -> float:
        return 1e12 * (self.peak_tflops_fp8 or 2 * self.peak_tflops_bf16)

    def to_dict(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "name device_names peak_tflops_bf16 peak_tflops_fp32 memory_gib hbm_gbps nvlink_gbps "
                "internode_gbps gpus_per_node rail_aggregation_max_nodes peak_tflops_fp8 fp8"
            ).split()
        }
        d["attention_kernels"] = list(self.attention_kernels)
        d["efficiency"] = dict(self.efficiency)
        if self.calibrated:
            d["calibrated"] = self.calibrated
        return d


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _from_dict(raw: dict, source: str) -> Profile:
    if not isinstance(raw, dict):
        raise SpecError("--hardware", f"{source} is not a YAML mapping")
    need = ("peak_tflops_bf16", "memory_gib", "hbm_gbps", "nvlink_gbps", "internode_gbps", "gpus_per_node")
    missing = [k for k in need if k not in raw]
    if missing:
        raise SpecError("--hardware", f"{source} lacks {', '.join(missing)}")
    eff = dict(raw.get("efficiency") or {})
    unknown = set(eff) - set(EFFICIENCY_KEYS)
    if unknown:
        raise SpecError("--hardware", f"{source}: unknown efficiency keys {sorted(unknown)}")
    defaults = yaml.safe_load((PROFILE_DIR / "a100-80gb.yaml").read_text())["efficiency"]
    for key in EFFICIENCY_KEYS:
        eff.setdefault(key, defaults.get(key, EFFICIENCY_DEFAULTS.get(key)))
    fp8 = raw.get("fp8", True)
    if not isinstance(fp8, bool):
        raise SpecError("--hardware", f"{source}: fp8 must be true or false")
    given = {"peak_tflops_fp8": raw["peak_tflops_fp8"]} if fp8 and "peak_tflops_fp8" in raw else {}
    for key, value in {**{k: raw[k] for k in need}, **eff, **given}.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise SpecError("--hardware", f"{source}: {key} must be a positive number")
    kernels = tuple(raw.get("attention_kernels") or ATTENTION)
    return Profile(
        name=str(raw.get("name", Path(source).stem)),
        peak_tflops_bf16=float(raw["peak_tflops_bf16"]),
        peak_tflops_fp32=float(raw.get("peak_tflops_fp32", raw["peak_tflops_bf16"] / 16)),
        memory_gib=float(raw["memory_gib"]),
        hbm_gbps=float(raw["hbm_gbps"]),
        nvlink_gbps=float(raw["nvlink_gbps"]),
        internode_gbps=float(raw["internode_gbps"]),
        gpus_per_node=int(raw["gpus_per_node"]),
        efficiency={k: float(v) for k, v in eff.items()},
        rail_aggregation_max_nodes=_positive_int(
            raw.get("rail_aggregation_max_nodes", Profile.rail_aggregation_max_nodes),
            "rail_aggregation_max_nodes",
            source,
        ),
        device_names=list(raw.get("device_names") or []),
        attention_kernels=kernels,
        calibrated=dict(raw.get("calibrated") or {}),
        source=source,
        peak_tflops_fp8=float(raw.get("peak_tflops_fp8", 2 * raw["peak_tflops_bf16"])) if fp8 else 0.0,
        fp8=fp8,
    )


def _positive_int(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError("--hardware", f"{source}: {key} must be a positive integer")
    return value


def load_profile(name_or_path: str) -> Profile:
    """A built-in name (a100-80gb, ...) or a path to a YAML profile."""
    if name_or_path in profile_names():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    elif name_or_path.endswith((".yaml", ".yml")) or os.path.sep in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise SpecError("--hardware", f"profile file {name_or_path!r} does not exist")
    else:
        raise SpecError(
            "--hardware",
            f"unknown hardware {name_or_path!r}; known: {', '.join(profile_names())} or a path to a profile YAML",
        )
    try:
        raw = read_yaml(str(path), "--hardware")  # a user's file: strict and bounded, as every spec
    except SpecError as e:
        raise SpecError("--hardware", e.reason if e.field == "--hardware" else f"{e.field}: {e.reason}") from None
    return _from_dict(raw, str(path))


def save_profile(profile: Profile, path: str | os.PathLike, header: str = "") -> None:
    text = yaml.safe_dump(profile.to_dict(), sort_keys=False)
    Path(path).write_text((header.rstrip() + "\n" if header else "") + text)
