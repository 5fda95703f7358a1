"""A GGUF file written as a Hugging Face directory: config, float32 safetensors, generation config, tokenizer.

transformers loads a GGUF itself (`from_pretrained(..., gguf_file=...)`), but for an architecture its newer GGUF
path does not cover (llama among them) its config, its tokenizer and its weights each open the file again through
`gguf.GGUFReader`, which makes array views of every vocabulary string on open, and its weight-name map rebuilds
gguf's name table once per submodule; a model saved from it must then be rebuilt without its quantizer. Most of a
first run's conversion went there rather than into the arithmetic. Here each step runs once, with the same
libraries' pieces, so the directory is the one transformers' loader would give, tensor for tensor:

- the metadata and tensor table: transformers' own GGUF reader, which leaves unread the string arrays nobody asks
  for (the tokenizer reads the vocabulary through it too);
- the config: the metadata renamed by transformers' GGUF config table (`GGUF_CONFIG_MAPPING`);
- the weights: de-quantized by `gguf.dequantize`, named through one gguf name table, and llama.cpp's layout undone
  by transformers' tensor processor for the architecture;
- the model: built once on the meta device (no weights allocated, none drawn at random), given the converted
  tensors, and written by `save_pretrained`;
- the tokenizer: the tokenizers-backed class, which builds it from the file's vocabulary, merges and template
  (`AutoTokenizer` would rebuild the model config from the file only to pick that same class).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from training.utils.errors import ModelLoadError

CONVERTED_ARCHITECTURES = ("llama",)
"""GGUF architectures whose config is a plain renaming of the metadata and whose tensors map one to one onto the
model's parameters: what this conversion is checked on (SmolLM2). Others go through transformers' own loader."""


def convert_gguf(gguf: Path, target: Path) -> None:
    """Write the model in `gguf` as a Hugging Face directory at `target` (created or overwritten)."""
    from transformers import AutoConfig, AutoModelForCausalLM, TokenizersBackend
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(gguf))
    architecture = metadata["general.architecture"]
    if architecture not in CONVERTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf} is a GGUF of architecture {architecture!r}; this conversion handles {CONVERTED_ARCHITECTURES}. "
            "Load it with transformers instead: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)"
        )
    config_fields = gguf_config_fields(metadata, tensor_names)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_fields), dtype=torch.float32)
    weights = gguf_weights(gguf, config_fields, model.state_dict())
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    unfilled = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if unfilled:
        raise ModelLoadError(f"{gguf} holds no tensor for the model's parameters {unfilled}")
    model.save_pretrained(target)
    TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(target)


def gguf_config_fields(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config's fields: each metadata key that transformers' GGUF config table renames (`llama.block_count` ->
    `num_hidden_layers`, `general.architecture` -> `model_type`, ...), and tied embeddings where llama.cpp wrote no
    separate output matrix."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    fields = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        section, _, name = key.partition(".")
        field = GGUF_CONFIG_MAPPING.get(section, {}).get(name)
        if field not in (None, -1):  # -1: a key the table names only to ignore it
            fields[field] = value
    return fields


def gguf_weights(gguf: Path, config_fields: dict, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{parameter name: float32 tensor}` for each tensor of the file that names one of `parameters`."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    header = GgufHeader.from_file(str(gguf))
    parameter_of = gguf_parameter_names(header.architecture, config_fields["num_hidden_layers"], parameters)
    # llama.cpp permutes the query and key rows for its rotary layout; the processor puts them back.
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config_fields)
    weights = {}
    for gguf_name, stored in load_gguf_state_dict(header).items():
        if gguf_name not in parameter_of:
            continue  # as transformers' loader does: a tensor the model has no parameter for (rope_freqs)
        values = dequantize(stored[...].numpy(), GGMLQuantizationType(stored.ggml_type))
        values = processor.process(weights=values, name=gguf_name).weights
        weights[parameter_of[gguf_name]] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return weights


def gguf_parameter_names(architecture: str, block_count: int, parameters) -> dict[str, str]:
    """`{GGUF tensor name: parameter name}` through gguf's name table for the architecture, built once."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(arch for arch, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_table = get_tensor_name_map(arch, block_count)
    names = {}
    for parameter in parameters:
        gguf_name = name_table.get_name(parameter, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            names[gguf_name] = parameter
    return names
