"""The plain single-device LLaMA (llama.py), its presets and config.json import (presets.py),
attention and RMSNorm kernels (kernels.py), FLOP conventions (flops.py), and what every engine
shares around the model: the optimizer and the precision context (training.py), Muon beside AdamW
(muon.py) and the per-op selective checkpointing policy (op_checkpoint.py)."""
