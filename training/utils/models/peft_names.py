"""What peft calls the trainer's one adapter and the files of an adapter directory: shared by `lora.py` and the
layers of `lora_layers.py` (which `lora.py` imports only where LoRA is used, so it cannot import them back)."""

ADAPTER = "default"
"""The one adapter the trainer creates (peft's default name)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
"""What peft's `save_pretrained` writes: the config, and the weights in one of these files."""
