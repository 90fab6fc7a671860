"""The native products over a GGUF's Q5_K, Q8_0 and Q4_0 matrices (``q5k_linear``,
``q8_0_linear``, ``q4_0_linear``) and over LocalSpec's 3-bit Q3_M (``q3m_linear``), their
weight formats (``kquant_formats``, ``q32_formats``) and their place in the forward beside Q4_K
and Q6_K.

The same promises as test_kernels.py makes for Q4_K: the formats read a file's bytes exactly as
gguf-py does; the product is the documented one (activations quantized to int8 per group of 32
times the file's weights) within float summation error; each row is bit for bit the same
whatever other rows share the call and however many threads run. Every test runs on the kernels
this machine serves and on the portable build (test_kernels_variants.py compares the SIMD
builds with the portable one bit for bit).
"""

from __future__ import annotations

import copy
import ctypes

import numpy as np
import pytest
import torch
from conftest import tiny_config
from kernel_helpers import (
    assert_matches_reference,
    q5k_bytes,
    random_inputs,
    random_weights,
    reference,
)
from transformers import AutoModelForCausalLM

from localspec.config import NATIVE_GGUF_TYPES
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.gguf_kquants import PARSERS
from localspec.runtime.kernels import (
    Q3MWeights,
    Q4_0Weights,
    Q5KWeights,
    Q8_0Weights,
    cat_rows,
    pack_q3m,
    pack_q4_0,
    pack_q5k,
    pack_q8_0,
    parse_q4_0,
    parse_q5k,
    parse_q8_0,
    quantize_q3m,
    quantize_q4_0,
    quantize_q4k,
    quantize_q5k,
    quantize_q6k,
    quantize_q8_0,
)
from localspec.runtime.kernels.kquant_formats import _quantize_k
from localspec.runtime.quant import (
    Q3MLinear,
    Q4_0Linear,
    Q4KLinear,
    Q5KLinear,
    Q6KLinear,
    Q8_0Linear,
)
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import export_weights

# type -> (its layer, its quantizer, its parser (None: no GGUF type), the largest q, q's dtype)
TYPES = {"Q5_K": (Q5KLinear, quantize_q5k, parse_q5k, 31, torch.uint8),
         "Q3_M": (Q3MLinear, quantize_q3m, None, 7, torch.uint8),
         "Q8_0": (Q8_0Linear, quantize_q8_0, parse_q8_0, 127, torch.int8),
         "Q4_0": (Q4_0Linear, quantize_q4_0, parse_q4_0, 15, torch.uint8)}


def test_every_native_type_has_a_parser() -> None:
    """What describe() calls native is what the reader parses: the config's names."""
    assert set(PARSERS) == set(NATIVE_GGUF_TYPES)


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(("n", "k"), [(48, 512), (16, 256)])
def test_quantizers_round_trip_within_their_bits(kind: str, n: int, k: int) -> None:
    """Each quantizer's fields are in their ranges (q, fp16 scales as a file stores them) and
    dequantize close to the input: the references below are real matrices of the type."""
    _, quantize, _, top, dtype = TYPES[kind]
    w = random_weights(n, k, seed=40)
    q = quantize(w)
    assert q.q.shape == (n, k) and q.q.dtype == dtype and int(q.q.abs().max()) <= top
    assert torch.equal(q.d, q.d.half().float())
    error = (q.dequantize() - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
    assert float(error) < {"Q5_K": 0.05, "Q8_0": 0.01, "Q4_0": 0.1, "Q3_M": 0.2}[kind], \
        float(error)


def test_q3m_fits_each_group_closer_than_its_span() -> None:
    """Q3_M's fitted scales and lows (``quantize_q3m``) against Q4_K's rule at 3 bits (the
    group's min to max on the grid): a fifth less error, the reason for the fit; q's third
    bit is used (a packing that dropped it would leave q <= 3)."""
    w = random_weights(64, 896, seed=50)
    fitted = quantize_q3m(w)
    spanned = Q3MWeights(*_quantize_k(w, 7, "Q3_M"))
    errors = [float((q.dequantize() - w).norm() / w.norm()) for q in (fitted, spanned)]
    assert errors[0] < 0.9 * errors[1], errors
    assert int(fitted.q.max()) == 7 and int(fitted.sc.max()) > 63  # 8-bit scales in use


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_parse_reads_gguf_quantized_bytes_as_gguf_py_does(kind: str) -> None:
    """Bytes gguf-py quantized (ggml's own rule, bit-exact with ggml-quants.c): the parser
    gives gguf-py's dequantized floats bit for bit, and our quantizer the same fields."""
    gguf = pytest.importorskip("gguf")
    _, quantize, parse, _, _ = TYPES[kind]
    n, k = 32, 320
    w = random_weights(n, k, seed=41)
    w[3, :32] = 0.0  # a zero block: d == 0
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w.numpy(), qtype)
    ours = parse(raw, n, k)
    theirs = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k)
    assert torch.equal(ours.dequantize(), torch.from_numpy(theirs))
    made = quantize(w)
    assert torch.equal(made.q, ours.q) and torch.equal(made.d, ours.d)


def test_parse_q5k_reads_ggml_bytes_as_gguf_py_does() -> None:
    """Q5_K bytes written from quantize_q5k's fields in ggml's layout: gguf-py dequantizes them
    to exactly the floats of parse_q5k and of the fields themselves."""
    gguf = pytest.importorskip("gguf")
    n, k = 32, 512
    made = quantize_q5k(random_weights(n, k, seed=42))
    raw = q5k_bytes(made)
    ours = parse_q5k(raw, n, k)
    for field in ("q", "sc", "mn", "d", "dmin"):
        assert torch.equal(getattr(ours, field), getattr(made, field)), field
    theirs = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K),
                        dtype=np.float32).reshape(n, k)
    assert torch.equal(ours.dequantize(), torch.from_numpy(theirs))


def test_parse_and_pack_refuse_wrong_shapes() -> None:
    for parse in (parse_q5k, parse_q8_0, parse_q4_0):
        with pytest.raises(ValueError, match="not a Q"):
            parse(np.zeros(100, np.uint8), 16, 256)
    with pytest.raises(ValueError, match="not a Q5_K"):  # a width that is not whole blocks
        parse_q5k(np.zeros(16 * 176, np.uint8), 16, 288)
    q5 = quantize_q5k(random_weights(16, 256, seed=43))
    q8, q4 = quantize_q8_0(random_weights(16, 256, seed=43)), quantize_q4_0(
        random_weights(16, 256, seed=43))
    with pytest.raises(ValueError, match="rows % 16"):
        pack_q5k(Q5KWeights(q5.q[:8], q5.sc[:8], q5.mn[:8], q5.d[:8], q5.dmin[:8]))
    with pytest.raises(ValueError, match="rows % 16"):
        pack_q8_0(Q8_0Weights(q8.q[:8], q8.d[:8]))
    with pytest.raises(ValueError, match="rows % 16"):
        pack_q4_0(Q4_0Weights(q4.q[:8], q4.d[:8]))
    q3 = quantize_q3m(random_weights(16, 256, seed=43))
    with pytest.raises(ValueError, match="rows % 16"):
        pack_q3m(Q3MWeights(q3.q[:8], q3.sc[:8], q3.mn[:8], q3.d[:8], q3.dmin[:8]))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q3m(random_weights(16, 48, seed=43))


# ----------------------------------------------------------------------------- the products


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(("n", "k"), [(48, 512), (16, 256), (32, 896), (16, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_torch_reference(lib: ctypes.CDLL, kind: str, n: int, k: int,
                                            with_bias: bool) -> None:
    """Group-quantized int8 activations times the type's weights (plus bias): the packing
    (nibbles, fifth bits, the +128 of Q8_0, the -8 of Q4_0) and the C arithmetic together."""
    layer_type, quantize, _, _, _ = TYPES[kind]
    weights = quantize(random_weights(n, k, seed=44))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(45)) if with_bias else None
    layer = layer_type.from_weights(weights, bias, lib)
    assert (layer.in_features, layer.out_features) == (k, n)
    x = random_inputs(5, k, seed=46)
    x[2] = 0.0  # an all-zero row: exactly the bias
    y = layer(x)
    assert_matches_reference(y, reference(x, weights, bias))
    assert torch.equal(y[2], bias if bias is not None else torch.zeros(n))


def test_extreme_q8_0_weights_do_not_saturate(lib: ctypes.CDLL) -> None:
    """Q8_0 weights at -128 and +127 against inputs at +-127 (AVX2's byte-pair products are
    at their largest): still the exact reference."""
    n, k = 16, 256
    q = torch.where(torch.arange(k) % 2 == 0, -128, 127).to(torch.int8).repeat(n, 1)
    weights = Q8_0Weights(q, torch.full((n, k // 32), 0.5))
    x = torch.where(torch.arange(k) % 4 < 2, -1.0, 1.0).repeat(3, 1)
    layer = Q8_0Linear.from_weights(weights, None, lib)
    assert_matches_reference(layer(x), reference(x, weights, None))


@pytest.mark.parametrize("kind", TYPES)
def test_rows_do_not_depend_on_the_batch_or_threads(lib: ctypes.CDLL, kind: str) -> None:
    """Each row of an M-row call, M = 1..20 (past the rows per pass: 8 or 4), is bit for bit
    that row alone, also at shifted positions, with one thread or two."""
    layer_type, quantize, _, _, _ = TYPES[kind]
    per_pass = lib.kernels_rows_per_pass()
    layer = layer_type.from_weights(quantize(random_weights(48, 512, seed=47)),
                                    torch.randn(48), lib)
    x = random_inputs(20, 512, seed=48)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    for m in range(1, 21):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    for start in (1, 3, per_pass - 1, per_pass + 3):
        assert torch.equal(layer(x[start:]), alone[start:]), start
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone) and torch.equal(two, alone)


@pytest.mark.parametrize("kind", TYPES)
def test_cat_equals_the_parts_bit_for_bit(lib: ctypes.CDLL, kind: str) -> None:
    """Fused layers (q|k|v, gate|up) built with cat give each part's own output."""
    layer_type, quantize, _, _, _ = TYPES[kind]
    first, second = (quantize(random_weights(n, 512, seed=n)) for n in (32, 48))
    fused = cat_rows([first, second])
    x = random_inputs(lib.kernels_rows_per_pass() + 2, 512, seed=49)
    parts = torch.cat([layer_type.from_weights(first, None, lib)(x),
                       layer_type.from_weights(second, None, lib)(x)], dim=1)
    assert torch.equal(layer_type.from_weights(fused, None, lib)(x), parts)


# ----------------------------------------------------------------------------- the forward


def test_w4a8_serves_every_type_in_one_native_stack(lib: ctypes.CDLL) -> None:
    """A tiny model whose matrices are exactly Q8_0, Q4_0, Q5_K, Q4_K, Q6_K and Q3_M (fused
    projections mixing them, as Q5_K_M files mix Q5_K and Q6_K): w4a8 serves each in its own
    kernel, the whole stack in one native call (decoder_forward dispatches every kind); a pass
    equals one-token steps bit for bit, and the model stays close to float."""
    config = tiny_config()
    config.hidden_size, config.num_attention_heads = 128, 4
    config.intermediate_size = 256
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kinds = {"self_attn.q_proj": (quantize_q8_0, Q8_0Linear),
             "self_attn.k_proj": (quantize_q4_0, Q4_0Linear),
             "self_attn.v_proj": (quantize_q5k, Q5KLinear),
             "self_attn.o_proj": (quantize_q3m, Q3MLinear),
             "mlp.gate_proj": (quantize_q5k, Q5KLinear), "mlp.up_proj": (quantize_q4k, Q4KLinear),
             "mlp.down_proj": (quantize_q6k, Q6KLinear)}
    mapping = {}
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            for name, (quantize, _) in kinds.items():
                module = model.get_submodule(f"model.layers.{i}.{name}")
                mapping[f"model.layers.{i}.{name}"] = quantize(module.weight)
                module.weight.copy_(mapping[f"model.layers.{i}.{name}"].dequantize())
    tokens = torch.randint(0, config.vocab_size, (24,),
                           generator=torch.Generator().manual_seed(12)).tolist()
    reference_logits = ModelRunner(model).forward(tokens)
    taken = copy.deepcopy(model).to(torch.bfloat16)
    decoder = CpuDecoder(taken, "w4a8", export_weights(taken, "w4a8", mapping), lib)
    assert decoder.native is not None
    for layer in decoder.layers:
        assert [type(p) for p in layer.qkv.parts] == [Q8_0Linear, Q4_0Linear, Q5KLinear]
        assert [type(p) for p in layer.gate_up.parts] == [Q5KLinear, Q4KLinear]
        assert type(layer.o) is Q3MLinear and type(layer.down) is Q6KLinear
    runner = ModelRunner(taken, decoder=decoder)
    steps = torch.cat([runner.forward([t]) for t in tokens])
    runner.reset()
    assert torch.equal(torch.cat([runner.forward(tokens[:10]), runner.forward(tokens[10:])]),
                       steps)
    # int8 activations, bf16 attention cache and 4- to 8-bit weights: a few percent at most
    error = float((steps - reference_logits).norm() / reference_logits.norm())
    assert error < 0.05, error
