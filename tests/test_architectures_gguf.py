"""A tiny Qwen3 as a GGUF file, end to end: written with the ``gguf`` package (every layer
matrix Q4_K by the repo's own quantizer, the tokenizer of the built-in Qwen2.5-Coder 0.5B,
whose vocabulary the model's embedding matches), read back by transformers, added to the model
library, served by the native stack ("w4a8": every layer in one native call), and generating
with n-gram speculation exactly what plain greedy decoding generates.

The shapes: hidden 256 over 4 heads of head_dim 128 (not hidden / heads = 64), two key-value
heads, two layers; Q4_K in a GGUF needs every matrix width to be a multiple of 256.
transformers' GGUF reader maps no ``qwen3.attention.key_length`` to ``head_dim`` and takes
Qwen3Config's default, 128: a Qwen3 GGUF of another head size would not load through it, so
128 is what is tested here (every released Qwen3 has it).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from localspec.config import ModelSpec
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import assemble_builtin
from localspec.models.describe import describe
from localspec.models.loading import load_model
from localspec.runtime.kernels import KernelUnavailable, Q4KWeights, load_kernels, quantize_q4k
from localspec.runtime.kernels.kquant_formats import Q4K_BLOCK_BYTES, SUPER, parse_q4k

pytestmark = pytest.mark.real_model  # reads the built-in 0.5B's tokenizer
TOKENIZER_SOURCE = "qwen2.5-coder-0.5b-instruct"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 256, 4, 2, 128, 512, 2
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
                   "tokenizer.chat_template")
# gguf tensor name (inside blk.N) -> transformers' module (inside model.layers.N)
_MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_VECTORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def q4k_bytes(w: Q4KWeights) -> np.ndarray:
    """``w`` [n, k] (k % 256 == 0) as a GGUF stores Q4_K: per row, blocks of 144 bytes (d and
    dmin in fp16, twelve bytes of 6-bit scales and mins, 128 of nibbles). The inverse of
    ``parse_q4k``, which checks it."""
    n, k = w.q.shape
    supers = k // SUPER
    blocks = np.zeros((n, supers, Q4K_BLOCK_BYTES), np.uint8)
    blocks[..., 0:2] = w.d.numpy().astype(np.float16).reshape(n, supers, 1).view(np.uint8)
    blocks[..., 2:4] = w.dmin.numpy().astype(np.float16).reshape(n, supers, 1).view(np.uint8)
    sc = w.sc.numpy().reshape(n, supers, 8).astype(np.uint8)
    mn = w.mn.numpy().reshape(n, supers, 8).astype(np.uint8)
    blocks[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    blocks[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    blocks[..., 12:16] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    q = w.q.numpy().reshape(n, supers, 4, 2, 32)  # [row, super, chunk, low/high nibble, 32]
    blocks[..., 16:] = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, supers, 128)
    raw = blocks.reshape(n, -1)
    back = parse_q4k(raw, n, k)
    assert all(torch.equal(getattr(back, f), getattr(w, f)) for f in ("q", "sc", "mn")), \
        "the Q4_K encoder is not parse_q4k's inverse"
    return raw


def tiny_qwen3(vocab: int) -> PreTrainedModel:
    """A random float32 Qwen3 of the shapes above, every norm weight random in [0.5, 1.5],
    the LM head tied to the embedding (as Qwen3's small models and a GGUF without
    ``output.weight``)."""
    config = Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FF,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, initializer_range=0.1,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    return model


def write_qwen3_gguf(path: Path, model: PreTrainedModel, tokenizer: gguf.GGUFReader) -> None:
    """``model`` as a GGUF: the embedding and every layer matrix Q4_K (the model's weights are
    set to the dequantized numbers, so the file and the model hold the same function), norms
    in F32, and ``tokenizer``'s tokenizer fields copied."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(model.config.max_position_embeddings)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(float(model.config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(model.config.rms_norm_eps))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key in _TOKENIZER_KEYS:
        field = tokenizer.fields[key]
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)

    def matrix(name: str, module: torch.nn.Module) -> None:
        weights = quantize_q4k(module.weight)
        with torch.no_grad():
            module.weight.copy_(weights.dequantize())
        writer.add_tensor(name, q4k_bytes(weights), raw_dtype=gguf.GGMLQuantizationType.Q4_K)

    def vector(name: str, param: torch.Tensor) -> None:
        writer.add_tensor(name, param.detach().float().numpy())

    matrix("token_embd.weight", model.model.embed_tokens)
    vector("output_norm.weight", model.model.norm.weight)
    for i, layer in enumerate(model.model.layers):
        for short, module in _MATRICES.items():
            matrix(f"blk.{i}.{short}.weight", layer.get_submodule(module))
        for short, module in _VECTORS.items():
            vector(f"blk.{i}.{short}.weight", layer.get_submodule(module).weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """The tiny Qwen3 GGUF and the float32 model of the same numbers."""
    try:
        load_kernels(tmp_path_factory.mktemp("kernels"))
    except KernelUnavailable as exc:
        pytest.skip(f"no Q4_K kernel here: {exc}")
    source = gguf.GGUFReader(str(assemble_builtin(BUILTIN_MODELS[TOKENIZER_SOURCE])))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    model = tiny_qwen3(vocab)
    path = tmp_path_factory.mktemp("qwen3-gguf") / "tiny-qwen3-Q4_K.gguf"
    write_qwen3_gguf(path, model, source)
    return path, model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions and packs of the tiny file go to a cache of this module's own (one for all
    its tests: the conversion is made once); the built-in's GGUF is read from the user's."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "qwen3-cache"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path_factory.getbasetemp() / "qwen3-models"))


def test_the_file_is_native_and_transformers_reads_it(qwen3_gguf: tuple[Path, PreTrainedModel]
                                                      ) -> None:
    """The library describes the file as a native Qwen3; the loaded w4a8 model (packed from
    the file, no conversion) runs every layer in the native stack and follows the float32
    model (see test_architectures: LIMIT); transformers reads the file back as the model it
    was written from (its conversion, made for an unquantized load, holds the same weights, bit
    for bit in the bfloat16 asked for)."""
    path, model = qwen3_gguf
    facts = describe(path)
    assert facts.architecture == "qwen3" and facts.native, facts
    loaded = load_model(ModelSpec(str(path), dtype="bfloat16", device="cpu",
                                  quantization="w4a8"))
    assert loaded.decoder is not None and loaded.decoder.native is not None
    assert loaded.decoder.head_dim == HEAD_DIM and loaded.decoder.heads == HEADS
    config = json.loads((loaded.folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == HEAD_DIM
    assert not (loaded.folder / "model.safetensors").exists()  # packed from the file itself
    unquantized = load_model(ModelSpec(str(path), dtype="bfloat16", device="cpu"))
    converted = load_file(unquantized.folder / "model.safetensors")
    expected = model.state_dict()
    assert set(converted) <= set(expected) and "model.layers.1.self_attn.k_norm.weight" in converted
    for name, tensor in converted.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    ids = loaded.tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0]
    served = loaded.runner().forward(ids)
    assert float((served - reference).norm() / reference.norm()) < 0.05


def test_models_add_and_generate_with_ngram_equals_plain_greedy(
        qwen3_gguf: tuple[Path, PreTrainedModel], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`localspec models add` takes the file (listed as qwen3); `generate` from a preset over
    it, on the native w4a8 path, gives with n-gram speculation exactly the tokens of plain
    greedy decoding, with drafts made along the way."""
    path, _ = qwen3_gguf
    code, out, err = run_cli(capsys, "models", "add", str(path))
    assert code == 0, err
    code, out, err = run_cli(capsys, "models", "list")
    assert code == 0 and "qwen3" in out, out + err
    preset = tmp_path / "tiny-qwen3.toml"
    preset.write_text(f"""name = "tiny qwen3"
description = "a tiny random Qwen3 GGUF"
hardware = "cpu"

[target]
model = {json.dumps(str(path))}
dtype = "bfloat16"
quantization = "w4a8"

[speculative_config]
method = "ngram"
num_speculative_tokens = 6
prompt_lookup_max = 3
prompt_lookup_min = 1

[sampling]
temperature = 0.0
max_new_tokens = 40
""")
    prompt = "one two three one two three one two three one two three"
    runs = {}
    for method in ("none", "ngram"):
        code, out, err = run_cli(capsys, "generate", "--preset", str(preset), "--json",
                                 "--raw", "--method", method, "--prompt", prompt)
        assert code == 0, err
        runs[method] = json.loads(out.strip().splitlines()[-1])
    plain, speculative = (runs[m]["samples"][0]["token_ids"] for m in ("none", "ngram"))
    assert len(plain) == 40 and speculative == plain
    assert runs["ngram"]["stats"]["drafted"] > 0
