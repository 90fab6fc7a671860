"""The CPU forward's weights: what ``export_weights`` makes of a transformers model, and the
linear layers ``layer_linear`` builds back from those tensors (freshly made or read from the
store). Kept apart from the forward itself (``decoder``): this is the part that changes when a
new weight format arrives.

Formats, by ``kind``: "dense" (the loaded dtype), "w8a8" (int8 rows with one scale each,
``W8A8Linear``), "w4a8" (a GGUF's Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 matrices as stored,
``quant.NATIVE_LINEARS``, a Q6_K LM head included; others w8a8), "requant-q4k" (every
layer matrix quantized to Q4_K, the head int8) and "requant-q3m" (every layer matrix in
LocalSpec's own 3-bit Q3_M, the head int8: a draft that reads a fifth fewer bytes a token).
A draft's head cut to frequent rows is served in Q4_0 where the native kernels are at hand
(``cut_linear``). In the w8a8 layers the down projection's weight is turned by a block
Hadamard rotation (``hadamard``) and the forward turns its input the same way (``rotate``):
see the decoder's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from transformers import PreTrainedModel

from localspec.runtime.kernels.kquant_formats import (
    BLOCK_ROWS,
    GROUP,
    Q3MWeights,
    Q4KWeights,
    Q5KWeights,
    Q6KWeights,
    cat_rows,
    quantize_q3m,
    quantize_q4k,
    unpack_q6k,
)
from localspec.runtime.kernels.q32_formats import (
    KQuantWeights,
    Q4_0Weights,
    Q8_0Weights,
    quantize_q4_0,
)
from localspec.runtime.quant import (
    NATIVE_LINEARS,
    DenseLinear,
    Q3MLinear,
    Q4_0Linear,
    Q4KLinear,
    Q5KLinear,
    Q6KLinear,
    Q8_0Linear,
    W8A8Linear,
    quantize_per_channel,
)

# Up to this many new tokens, each query row attends in a call of its own over exactly the keys
# it may see. A masked batch would sum over a longer, zero-padded row, and float sums of another
# length round differently: a verify pass must compute each token bit for bit as the one-token
# step of plain decoding does (without it, real prompts diverged at near-ties;
# docs/research-log.md).
# Rotations, too, go row by row up to this many rows.
ROW_ATTENTION_MAX = 128
ROTATION_BLOCK = 256  # the largest Hadamard block the down projection's input is turned by
Linear = Callable[[torch.Tensor], torch.Tensor]


def hadamard(width: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of the largest power-of-two block (at most
    ROTATION_BLOCK) that divides ``width``: [block, block] float32, symmetric, H @ H = I."""
    block = 1
    while block < ROTATION_BLOCK and width % (2 * block) == 0:
        block *= 2
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / block**0.5


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [n, width] times the block-diagonal of ``h``. Up to ROW_ATTENTION_MAX rows, each row
    is turned in a call of its own: a float32 matmul over several rows may block its sums
    differently from one over a single row (seen for some widths), and a verify pass must
    compute each token exactly as a one-token step does."""
    n, width = x.shape
    block = h.shape[0]
    if n == 1 or n > ROW_ATTENTION_MAX:
        return (x.reshape(n, width // block, block) @ h).reshape(n, width)
    return torch.cat([(row.reshape(width // block, block) @ h).reshape(1, width)
                      for row in x])


# The serving of each form a file's matrix is kept in, by the name ``_segments`` gives it.
_NATIVE: dict[str, tuple[type, type[Q4KLinear]]] = {
    "q4k": (Q4KWeights, Q4KLinear), "q5k": (Q5KWeights, Q5KLinear),
    "q6k": (Q6KWeights, Q6KLinear), "q8_0": (Q8_0Weights, Q8_0Linear),
    "q4_0": (Q4_0Weights, Q4_0Linear), "q3m": (Q3MWeights, Q3MLinear)}
# A draft's kinds that quantize its matrices again: the quantizer, and the form a file's
# matrix may already be in to be kept as it is (None: none is kept).
_REQUANTIZE = {"requant-q4k": (quantize_q4k, Q4KWeights), "requant-q3m": (quantize_q3m, None)}


def _fused(kind: str, modules: list[nn.Linear],
           exact: list[KQuantWeights] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one fused linear layer: the packed ``exact`` file weights (a kind of
    ``_NATIVE``), int8 rows and scales ("w8a8") or the weight ("dense"), and the bias if any
    module has one."""
    if kind in _NATIVE:
        linear = _NATIVE[kind][1]
        tensors = linear.PACK(cat_rows(exact or []))
    else:
        weight = modules[0].weight.detach() if len(modules) == 1 else torch.cat(
            [m.weight.detach() for m in modules])
        tensors = dict(zip(("q", "scale"), quantize_per_channel(weight), strict=True)
                       ) if kind == "w8a8" else {"weight": weight}
    if any(m.bias is not None for m in modules):
        tensors["bias"] = torch.cat([torch.zeros(m.out_features) if m.bias is None
                                     else m.bias.detach().float() for m in modules])
    return tensors


def _exact(module: nn.Linear, name: str, stored: Mapping[str, KQuantWeights]
           ) -> KQuantWeights | None:
    """The module's file weights (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0) if ``stored`` has them and
    they are exactly its weight (as loaded, in its dtype): never another model's numbers. A
    module without a weight (a skeleton built for the file ``stored`` comes from) takes them as
    they are."""
    if name not in stored:
        return None
    weights = stored[name]
    weight = module.weight.detach()
    if weight.numel() == 0:  # a skeleton filled from the file that holds them (gguf_pack)
        return weights if weights.q.shape == (module.out_features, module.in_features) else None
    if weights.q.shape != weight.shape or not torch.equal(
            weights.dequantize().to(weight.dtype), weight):
        return None
    return weights


def _segments(modules: list[nn.Linear], names: list[str],
              stored: Mapping[str, KQuantWeights], requantize: str | None
              ) -> list[tuple[str, list[nn.Linear], list[KQuantWeights]]]:
    """Consecutive modules of one fused layer grouped by how they are served: a kind of
    ``_NATIVE`` (exact file weights; rows in blocks of 16, inputs in groups of 32) or "w8a8". With
    ``requantize`` (a kind of ``_REQUANTIZE``) every matrix is in its form (a draft's: the
    fewest bytes)."""
    out: list[tuple[str, list[nn.Linear], list[KQuantWeights]]] = []
    for module, name in zip(modules, names, strict=True):
        exact = None
        if module.out_features % 16 == 0 and module.in_features % 32 == 0:
            exact = _exact(module, name, stored)
            if requantize is not None:
                quantize, kept = _REQUANTIZE[requantize]
                if kept is None or not isinstance(exact, kept):
                    exact = quantize(module.weight)
        kind = next((name for name, (form, _) in _NATIVE.items() if type(exact) is form),
                    "w8a8")
        if out and out[-1][0] == kind:
            out[-1][1].append(module)
            if exact is not None:
                out[-1][2].append(exact)
        else:
            out.append((kind, [module], [] if exact is None else [exact]))
    return out


def export_weights(model: PreTrainedModel, kind: str = "w8a8",
                   q4k: Mapping[str, KQuantWeights] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor the CPU forward needs, quantized as ``kind`` says, by name (what
    ``localspec.models.packed_store`` saves so that later starts skip the quantization). The
    model's layer weights are released as they are converted.

    "w4a8": the matrices ``q4k`` holds (by module name, as a GGUF file stores them: Q4_K,
    Q5_K, Q6_K, Q8_0 or Q4_0) that are exactly the model's weights are kept so for the native
    kernels; all others are w8a8. "requant-q4k": every other layer matrix is quantized to Q4_K;
    "requant-q3m": every layer matrix to Q3_M. A fused layer is then stored as segments
    ``<name>.<s>.*`` of one kind each."""
    q4k = q4k or {}
    backbone = model.base_model
    module_names = {module: name for name, module in model.named_modules()}
    weights = {"embed": backbone.embed_tokens.weight.detach().clone(),
               "norm": backbone.norm.weight.detach().float()}
    segmented = kind == "w4a8" or kind in _REQUANTIZE
    if kind != "dense":
        weights["down_rotation"] = hadamard(model.config.intermediate_size)
    for i, layer in enumerate(backbone.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                 "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
        for name, modules in parts.items():
            segments = [(kind, modules, [])] if not segmented else _segments(
                modules, [module_names[m] for m in modules], q4k,
                kind if kind in _REQUANTIZE else None)
            for s, (seg_kind, seg_modules, exact) in enumerate(segments):
                prefix = f"layers.{i}.{name}.{s}" if segmented else f"layers.{i}.{name}"
                if name == "down" and seg_kind == "w8a8":  # x W^T = (x H)(W H)^T
                    down = mlp.down_proj.weight.detach().float()
                    mlp.down_proj.weight = nn.Parameter(
                        rotate(down, weights["down_rotation"]), requires_grad=False)
                for key, tensor in _fused(seg_kind, seg_modules, exact).items():
                    weights[f"{prefix}.{key}"] = tensor
        weights[f"layers.{i}.norm1"] = layer.input_layernorm.weight.detach().float()
        weights[f"layers.{i}.norm2"] = layer.post_attention_layernorm.weight.detach().float()
        if hasattr(attn, "q_norm"):  # Qwen3: an RMSNorm of every query and key head
            weights[f"layers.{i}.q_norm"] = attn.q_norm.weight.detach().float()
            weights[f"layers.{i}.k_norm"] = attn.k_norm.weight.detach().float()
        release_weights(layer)
    head = model.get_output_embeddings()
    exact = _exact(head, "lm_head", q4k) if kind == "w4a8" else None
    if not isinstance(exact, Q6KWeights) or head.out_features % 16:
        exact = None
    head_as = "dense" if kind == "dense" else "w8a8" if exact is None else "q6k"
    for key, tensor in _fused(head_as, [head], None if exact is None else [exact]).items():
        weights[f"head.{key}"] = tensor
    return weights


def _one_linear(weights: Mapping[str, torch.Tensor], prefix: str, lib: object | None) -> Linear:
    bias = weights.get(f"{prefix}.bias")
    for linear in (Q6KLinear, Q5KLinear, Q8_0Linear, Q4_0Linear, Q3MLinear,
                   Q4KLinear):  # Q4_K's keys last
        if all(f"{prefix}.{k}" in weights for k in linear.PACKED):
            if lib is None:
                raise ValueError(f"{prefix} is stored in {linear.WHAT}, and no kernel was given")
            return linear({k: weights[f"{prefix}.{k}"] for k in linear.PACKED}, bias, lib)
    if f"{prefix}.q" in weights:
        return W8A8Linear(weights[f"{prefix}.q"], weights[f"{prefix}.scale"], bias)
    return DenseLinear(weights[f"{prefix}.weight"], bias)


# The first tensor of each way a layer is stored (a native kernel's, w8a8's, dense)
_FIRST_KEYS = (*dict.fromkeys(linear.PACKED[0] for linear in NATIVE_LINEARS), "q", "weight")


class ConcatLinear:
    """Several linear layers on the same input, outputs side by side (a fused layer whose
    parts are stored in different forms, e.g. Q4_K q/k and Q6_K v)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def layer_linear(weights: Mapping[str, torch.Tensor], prefix: str, lib: object | None) -> Linear:
    """The layer stored under ``prefix``: one tensor set, or segments ``prefix.0``, ..."""
    if not any(f"{prefix}.0.{k}" in weights for k in _FIRST_KEYS):
        return _one_linear(weights, prefix, lib)
    parts = []
    while any(f"{prefix}.{len(parts)}.{k}" in weights for k in _FIRST_KEYS):
        parts.append(_one_linear(weights, f"{prefix}.{len(parts)}", lib))
    return parts[0] if len(parts) == 1 else ConcatLinear(parts)


def refine_top_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LM head in the weight's dtype, then float32-exact logits near each row's maximum.

    hidden: [n, d] float32; weight: [vocab, d] bf16/fp16. Returns [n, vocab] float32. The
    margin covers bf16 rounding of the inputs and of the output (2^-8 relative) many times over.
    """
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()
    top = logits.max(dim=-1, keepdim=True).values
    margin = torch.clamp(top.abs() * 2.0**-5, min=0.25)
    rows, cols = torch.nonzero(logits >= top - margin, as_tuple=True)
    logits[rows, cols] = (hidden[rows] * weight[cols].float()).sum(dim=-1)
    return logits


def spread_logits(sub: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [..., len(rows)] of a cut vocabulary -> [..., vocab_size], -inf at the other ids
    (a cut head can never propose them)."""
    logits = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
    logits[..., rows] = sub
    return logits


class _PaddedRows:
    """A native linear over rows padded to the kernels' 16-row blocks; the padding's outputs
    are dropped."""

    def __init__(self, linear: Linear, out_features: int) -> None:
        self.linear, self.out_features = linear, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[:, : self.out_features]


# Rows of a cut head quantized at a time: the float rows of the 0.5B's 64k-row cut are 235 MB,
# and quantizing them whole multiplies the load's peak memory and time; in chunks both stay
# small (docs/research-log.md, "A draft's cut head in Q4_0").
CUT_CHUNK = 8192


def cut_linear(rows_of: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
               lib: object) -> Linear:
    """A draft's LM head cut to token ``ids`` in Q4_0 for the native kernel; ``rows_of(ids)``
    gives those rows as float32 [n, hidden] (``LMHead.rows``).

    The head is a small draft model's largest matmul, and at one row it is all memory traffic,
    so Q4_0's fewer bytes make it several times faster than oneDNN's int8; a draft only
    guesses, and Q4_0 hardly moves its guesses (docs/research-log.md, "A draft's cut head in
    Q4_0"). The rows are
    padded to whole 16-row blocks with copies of the last one, whose outputs are dropped. A
    width the kernels cannot take stays int8."""
    if rows_of(ids[:1]).shape[1] % GROUP:
        return W8A8Linear.from_float(rows_of(ids))
    padded = torch.cat([ids, ids[-1:].expand(-len(ids) % BLOCK_ROWS)])
    weights = cat_rows([quantize_q4_0(rows_of(padded[start:start + CUT_CHUNK]))
                        for start in range(0, len(padded), CUT_CHUNK)])
    return _PaddedRows(Q4_0Linear.from_weights(weights, None, lib), len(ids))


class LMHead:
    """The output projection, whole or cut to some vocabulary rows (a draft's FR-Spec head).

    Kept as ``export_weights`` stored it (int8 rows and scales, a file's packed Q6_K, or the
    dense weight) so that any cut can be made later; cuts are packed once each. Only drafts
    cut their head, and a draft only guesses, so where the native kernels are at hand a cut is
    served in Q4_0 (``cut_linear``); elsewhere in int8 (a Q6_K head's) or as stored.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], lib: object | None = None) -> None:
        """``tensors``: export_weights' ``head.*`` entries without the prefix; ``lib`` the
        kernel library for a Q6_K head."""
        self.tensors = dict(tensors)
        self.linear = "q6k" if "qh" in tensors else "w8a8" if "q" in tensors else "dense"
        if self.linear == "q6k":
            blocks, _, block_rows = tensors["d"].shape
            self.vocab_size = blocks * block_rows
        else:
            self.vocab_size = int(tensors["q" if self.linear == "w8a8" else "weight"].shape[0])
        self.lib = lib
        self._packed: dict[tuple[int, ...] | None, Linear] = {}

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's rows for token ids ``ids`` [n], float32 [n, hidden], as served (what a
        trained head's LM head starts from)."""
        if self.linear == "q6k":  # unpack only the 16-row blocks holding ids (all: ~1 GB float)
            blocks, where = torch.unique(ids // 16, return_inverse=True)
            count = self.tensors["d"].shape[0]
            part = {name: self.tensors[name].view(count, -1, *self.tensors[name].shape[2:])[blocks]
                    for name in ("qs", "qh", "sc", "d")}
            return unpack_q6k(part).dequantize()[where * 16 + ids % 16]
        if self.linear == "w8a8":
            return self.tensors["q"][ids].float() * self.tensors["scale"][ids, None]
        return self.tensors["weight"][ids].float()

    def part(self, rows: torch.Tensor | None) -> Linear:
        """The head cut to ``rows`` (all when None), packed once per cut."""
        key = None if rows is None else tuple(rows.tolist())
        if key not in self._packed:
            if rows is None:
                self._packed[key] = _one_linear({f"head.{k}": t for k, t in self.tensors.items()},
                                                "head", self.lib)
            elif self.lib is not None:
                self._packed[key] = cut_linear(self.rows, rows, self.lib)
            elif self.linear == "dense":
                self._packed[key] = DenseLinear(self.tensors["weight"][rows].contiguous(), None)
            elif self.linear == "w8a8":
                self._packed[key] = W8A8Linear(self.tensors["q"][rows].contiguous(),
                                               self.tensors["scale"][rows].contiguous())
            else:
                self._packed[key] = W8A8Linear.from_float(self.rows(rows))
        return self._packed[key]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None,
               part: Linear | None = None) -> torch.Tensor:
        """Float32 logits [n, vocab]; outside ``rows`` (when given) they are -inf. ``part`` is
        ``part(rows)`` if the caller kept it (finding a cut by its rows costs a hash of them)."""
        sub = (part or self.part(rows))(hidden)
        return sub if rows is None else spread_logits(sub, rows, self.vocab_size)


def release_weights(model: nn.Module) -> None:
    """Drop every weight of ``model`` (the packed copies replace them), so that one copy is in
    memory; the module tree stays for its config and generation settings."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(0, dtype=param.dtype),
                                               requires_grad=False))
