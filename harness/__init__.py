"""Layout harness: measure LLaMA training layouts under the own 3D engine, DeepSpeed and FSDP."""

__version__ = "0.1.0"
