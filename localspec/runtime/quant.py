"""Quantized linear layers for CPU decoding.

``W8A8Linear`` is the fast one: int8 weights with one scale per output channel, activations
quantized to 8 bits *per row* (per token) on the fly, the product accumulated in int32 by
oneDNN (``torch.ops.onednn.qlinear_pointwise``, AMX/VNNI on x86). Why per row: the int32
accumulation is exact and every scaling is elementwise, so a row's output does not depend on
which other rows share the call. A verify pass over k+1 tokens then computes, bit for bit, what
k+1 one-token steps compute, so speculation stays exactly lossless against the quantized model.
fbgemm's dynamic quantization (``torch.ao``) uses one activation scale per *tensor* instead:
its output for a token changes with the tokens beside it, and Qwen2.5's outlier activations
crush everything else in the tensor onto a few levels (its top-1 agreement with bf16 falls
far below per-row quantization's; docs/research-log.md).

``Q4KLinear`` reads a third of those bytes for matrices a GGUF file stores as Q4_K: its weights
exactly as the file has them, times int8 activations with one scale per group of 32, in a
native kernel (``localspec.runtime.kernels``) whose rows, too, do not depend on each other;
``Q6KLinear`` does the same for a file's Q6_K matrices (6.6 bits a weight), and ``Q5KLinear``,
``Q8_0Linear``, ``Q4_0Linear`` for its Q5_K (5.5), Q8_0 (8.5) and Q4_0 (4.5) matrices.
``Q3MLinear`` serves LocalSpec's own 3-bit Q3_M (3.75 bits a weight as packed), a draft's
matrices quantized again (``quantize_q3m``).

``Int8WeightOnlyLinear`` (``_weight_int8pack_mm``) reads the same bytes but costs more per row:
fine for a one-token draft step, poor for verifying 16 tokens.

All layers take and return float32 [n, in] -> [n, out].
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch
from torch import nn

from localspec.config import MAX_SPECULATIVE_TOKENS
from localspec.runtime.kernels.abi import (
    KIND_Q3_M,
    KIND_Q4_0,
    KIND_Q4_K,
    KIND_Q5_K,
    KIND_Q6_K,
    KIND_Q8_0,
)
from localspec.runtime.kernels.kquant_formats import (
    Q3M_PACKED,
    Q4K_PACKED,
    Q5K_PACKED,
    Q6K_PACKED,
    pack_q3m,
    pack_q4k,
    pack_q5k,
    pack_q6k,
)
from localspec.runtime.kernels.q32_formats import (
    Q4_0_PACKED,
    Q8_0_PACKED,
    KQuantWeights,
    pack_q4_0,
    pack_q8_0,
)

EXACT_ROWS = MAX_SPECULATIVE_TOKENS + 1  # the widest verify pass: fed to oneDNN unpadded
ROW_PIECE = 256  # longer feeds go in pieces of this many rows (see ``row_pieces``) ...
ROW_STEP = 32  # ... the last one padded to a multiple of this many


QUANTIZE_ROWS = 8192  # rows quantized at a time: a head's float32 copies are never whole


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights [out, in] with one float32 scale per output row. Each row is
    computed on its own, so going QUANTIZE_ROWS rows at a time changes no bit, and a 151,936-row
    LM head's float32 temporaries stay 0.1 GB instead of several times its 0.5-0.9 GB."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        w = weight[start:start + QUANTIZE_ROWS].detach().float()
        part = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q[start:start + len(w)] = torch.round(w / part[:, None]).clamp(-127, 127)
        scale[start:start + len(w)] = part
    return q, scale


class W8A8Linear:
    """y = dequant(int8(x) @ int8(W)^T) + b with per-token activation, per-channel weight scales.

    The activation is quantized as uint8 with zero point 128 and scale 1 after dividing each row
    by absmax/127; the row's scale is applied to the output afterwards (it commutes with the
    matmul), so oneDNN sees one static per-tensor scale and every row keeps its own.
    """

    def __init__(self, q: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        """From int8 rows ``q`` [out, in] and their float32 scales (``quantize_per_channel``)."""
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.weight_scale = weight_scale
        self.weight_zero = torch.zeros(self.out_features, dtype=torch.int32)
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W8A8Linear:
        return cls(*quantize_per_channel(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)
        q = torch.round(x / scale).add_(128.0).to(torch.uint8)
        pieces = row_pieces(q.shape[0])
        if len(pieces) == 1 and pieces[0][1] == pieces[0][2]:
            y = self._matmul(q)
        else:  # a long feed: in pieces, the last one padded with zero rows (uint8 128)
            y = torch.cat([self._matmul(_padded(q[start:start + rows], size))[:rows]
                           for start, rows, size in pieces])
        y.mul_(scale)
        return y if self.bias is None else y.add_(self.bias)

    def _matmul(self, q: torch.Tensor) -> torch.Tensor:
        """oneDNN's int32 product of uint8 rows ``q`` [n, in] with the weight: [n, out]."""
        return torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, self.packed, self.weight_scale,
                                                  self.weight_zero, None, 1.0, 0, torch.float32,
                                                  "none", [], "")


def _padded(q: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 activation rows ``q`` [n, in] followed by rows of zeros (128) up to ``size``."""
    if q.shape[0] == size:
        return q
    return torch.cat([q, q.new_full((size - q.shape[0], q.shape[1]), 128)])


def row_pieces(n: int) -> list[tuple[int, int, int]]:
    """How ``W8A8Linear`` hands ``n`` rows to oneDNN: (start, rows, size) per call, ``size -
    rows`` of them padding.

    oneDNN compiles a primitive for each input shape it meets and keeps up to 1,024 of them
    (~0.35 MB each for a 576 -> 3072 layer). A chat answer reads the whole conversation, a
    length never seen before: fed as one call, every answer left new primitives behind (1.4 MB
    an answer on SmolLM2's four layer shapes). So up to EXACT_ROWS rows (a verify pass, a
    one-token step) go as they are, and more go in pieces of ROW_PIECE whose last one is padded
    to a multiple of ROW_STEP (at most ROW_STEP - 1 rows of padding a feed): a layer meets at
    most EXACT_ROWS + ROW_PIECE // ROW_STEP - 1 row counts. Rows are independent (per-row
    scales, exact int32 sums), so the padding changes no row's output."""
    if n <= EXACT_ROWS:
        return [(0, n, n)]
    pieces = [(start, ROW_PIECE, ROW_PIECE) for start in range(0, n - ROW_PIECE + 1, ROW_PIECE)]
    start = len(pieces) * ROW_PIECE
    tail = n - start
    if tail:
        pieces.append((start, tail, -(-tail // ROW_STEP) * ROW_STEP))
    return pieces


class Q4KLinear:
    """y = x W^T + b with W in Q4_K (see ``localspec.runtime.kernels``); float32 in and out.
    The other GGUF types' layers are this one with another kernel and packing."""

    PACKED = Q4K_PACKED  # the kernel's tensors, in its argument order
    FUNCTION, WHAT, KIND = "q4k_linear", "Q4_K", KIND_Q4_K  # KIND: decoder_forward's KPart kind
    QS_BITS = 4  # bits a weight in PACKED[0]
    PACK = staticmethod(pack_q4k)

    def __init__(self, packed: Mapping[str, torch.Tensor], bias: torch.Tensor | None,
                 lib: ctypes.CDLL) -> None:
        """From the packed tensors (``pack_q4k``, or the same read back from the store)."""
        self.packed = {name: packed[name].contiguous() for name in self.PACKED}
        blocks, _, rows = self.packed["d"].shape
        self.out_features = blocks * rows
        self.in_features = (self.packed[self.PACKED[0]].numel() * 8
                            // (self.QS_BITS * self.out_features))
        self.bias = None if bias is None else bias.detach().float()
        self._kernel = getattr(lib, self.FUNCTION)
        self._pointers = [self.packed[name].data_ptr() for name in self.PACKED]

    @classmethod
    def from_weights(cls, weights: KQuantWeights, bias: torch.Tensor | None,
                     lib: ctypes.CDLL) -> Q4KLinear:
        """From unpacked weights of the class's type (``Q4KWeights`` here)."""
        return cls(cls.PACK(weights), bias, lib)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:  # the kernel would read past x
            raise ValueError(f"expected input [n, {self.in_features}], got {list(x.shape)}")
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        if self._kernel(x.data_ptr(), x.shape[0], self.in_features, *self._pointers,
                        self.out_features, y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"the {self.WHAT} kernel could not allocate its scratch memory")
        return y if self.bias is None else y.add_(self.bias)


class Q6KLinear(Q4KLinear):
    """The same for W in Q6_K (``pack_q6k``): 6.6 bits a weight where int8 reads 8."""

    PACKED = Q6K_PACKED
    FUNCTION, WHAT, KIND = "q6k_linear", "Q6_K", KIND_Q6_K
    PACK = staticmethod(pack_q6k)


class Q5KLinear(Q4KLinear):
    """The same for W in Q5_K (``pack_q5k``: the nibbles and fifth bits in one tensor)."""

    PACKED = Q5K_PACKED
    FUNCTION, WHAT, KIND, QS_BITS = "q5k_linear", "Q5_K", KIND_Q5_K, 5
    PACK = staticmethod(pack_q5k)


class Q8_0Linear(Q4KLinear):
    """The same for W in Q8_0 (``pack_q8_0``): one scale per 32 weights of 8 bits."""

    PACKED = Q8_0_PACKED
    FUNCTION, WHAT, KIND, QS_BITS = "q8_0_linear", "Q8_0", KIND_Q8_0, 8
    PACK = staticmethod(pack_q8_0)


class Q4_0Linear(Q4KLinear):
    """The same for W in Q4_0 (``pack_q4_0``): one scale per 32 weights of 4 bits."""

    PACKED = Q4_0_PACKED
    FUNCTION, WHAT, KIND = "q4_0_linear", "Q4_0", KIND_Q4_0
    PACK = staticmethod(pack_q4_0)


class Q3MLinear(Q4KLinear):
    """The same for W in Q3_M (``pack_q3m``: the low 2 bits and the third in one tensor)."""

    PACKED = Q3M_PACKED
    FUNCTION, WHAT, KIND, QS_BITS = "q3m_linear", "Q3_M", KIND_Q3_M, 3
    PACK = staticmethod(pack_q3m)


NATIVE_LINEARS = (Q4KLinear, Q5KLinear, Q6KLinear, Q8_0Linear, Q4_0Linear, Q3MLinear)


class DenseLinear:
    """y = x W^T + b in the weight's dtype (bfloat16 here), returned as float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else bias.detach().to(self.weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).float()


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (W_int8 * scale)^T + b, with per-output-row symmetric scales (an nn.Module: it
    replaces nn.Linear inside a Hugging Face model)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_per_channel(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                  requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.scale.dtype)
        y = torch._weight_int8pack_mm(x2, self.weight_int8, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_int8_weight_only(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear (except names ending in ``skip``) in place; return the count."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not name.endswith(skip)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8WeightOnlyLinear(module))
    return len(targets)
