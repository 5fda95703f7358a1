"""The model itself: loading a causal LM and its tokenizer, LoRA adapters and layers, frozen casts, FLOP counts,
and the CPU attention the trainer and the engine patch in."""
