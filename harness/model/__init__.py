"""The plain single-device LLaMA, its presets, kernels and FLOP counting."""
