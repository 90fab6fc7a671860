"""The whole decoder stack in one native call (``decoder_forward`` in
``kernels/decoder_stack.c``).

Why: with the weights in the Q4_K / Q6_K kernels, what is left of a step in Python is the glue
between them: about 35 tensor calls a layer (norms, RoPE, cache writes, attention, SwiGLU,
residual adds), each a few microseconds of dispatch for a few thousand numbers, which adds up
to a sizeable share of a one-token step and of a verify pass, and more of a small draft's step
(docs/research-log.md). The
C function does the same work row by row in a fixed order, so a verify pass stays
bit-identical to one-token steps (tests check it), as the Python loop's per-row attention
does.

``NativeStack.build`` returns None for a decoder it cannot run (a layer in int8 or dense, a
float32 cache, a shape the attention kernel does not take): the Python loop serves those.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from localspec.runtime.kernels.abi import MAX_PARTS, KFused, KLayer, KModel, KStep
from localspec.runtime.kernels.row_attention import RowAttention
from localspec.runtime.quant import Q4KLinear
from localspec.runtime.weight_formats import ConcatLinear, Linear


def _fused(linear: Linear, width: int) -> KFused | None:
    """The C description of a projection from ``width`` inputs (None: not all in native
    kernels)."""
    parts = linear.parts if isinstance(linear, ConcatLinear) else [linear]
    if len(parts) > MAX_PARTS:
        return None
    fused = KFused(parts=len(parts))
    for slot, part in zip(fused.part, parts, strict=False):
        if not isinstance(part, Q4KLinear) or part.in_features != width:  # each native one is
            return None
        slot.kind = part.KIND
        slot.n = part.out_features
        for i, name in enumerate(part.PACKED):
            slot.t[i] = part.packed[name].data_ptr()
        slot.bias = None if part.bias is None else part.bias.data_ptr()
    return fused


class NativeStack:
    """``CpuDecoder``'s layers as ``decoder_forward`` takes them (``KModel``, checked against
    the library by ``abi.mismatch`` when it was loaded); the tensors stay owned by the
    decoder's layers (and the norms kept here), so they outlive every call."""

    def __init__(self, lib: ctypes.CDLL, layers: ctypes.Array, norms: list[torch.Tensor],
                 shape: tuple[int, int, int, int, int], eps: float, scale: float) -> None:
        self._run = lib.decoder_forward
        self._layers, self._norms = layers, norms
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate = shape
        self.eps, self.scale = eps, scale
        self._model = KModel(ctypes.addressof(layers), len(layers), *shape, eps, scale)

    @classmethod
    def build(cls, lib: ctypes.CDLL, layers: Sequence[Any], hidden: int, heads: int,
              kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
              cache_dtype: torch.dtype) -> NativeStack | None:
        """For ``CpuDecoder`` layers (its ``_Layer``s); None when the C stack cannot run them."""
        if (not RowAttention.fits(heads, kv_heads, head_dim, cache_dtype)
                or hidden % 16 or intermediate % 16):
            return None
        array = (KLayer * len(layers))()
        norms: list[torch.Tensor] = []
        q_size = heads * head_dim
        for slot, layer in zip(array, layers, strict=True):
            if layer.down_rotated:
                return None
            projections = [_fused(layer.qkv, hidden), _fused(layer.o, q_size),
                           _fused(layer.gate_up, hidden), _fused(layer.down, intermediate)]
            widths = [None if p is None else sum(p.part[i].n for i in range(p.parts))
                      for p in projections]
            if widths != [q_size + 2 * kv_heads * head_dim, hidden, 2 * intermediate, hidden]:
                return None
            slot.qkv, slot.o, slot.gate_up, slot.down = projections
            for name in ("norm1", "norm2", "q_norm", "k_norm"):  # a NULL pointer: no norm
                if getattr(layer, name) is None:
                    continue
                norm = getattr(layer, name).float().contiguous()
                norms.append(norm)
                setattr(slot, name, norm.data_ptr())
        return cls(lib, array, norms, (hidden, heads, kv_heads, head_dim, intermediate), eps,
                   scale)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, start: int,
                 feature_layers: Sequence[int] = (),
                 parents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run every layer over x [n, hidden] float32 (in place: the last layer's output,
        before the final norm) at positions start..; keys and values are the cache's
        [layers, kv_heads, capacity, head_dim] bf16 tensors. Returns the hidden states entering
        ``feature_layers`` (each < the number of layers) as [n, len * hidden], or None.
        ``parents`` [n] int64: the rows form a tree (see ``attend_tree``), cos and sin are at
        each row's own position."""
        n = x.shape[0]
        if not (x.dtype == torch.float32 and x.is_contiguous() and keys.is_contiguous()
                and values.is_contiguous()) or start + n > keys.shape[2]:
            raise ValueError("decoder_forward needs contiguous float32 rows and room in the "
                             "cache")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        count = len(feature_layers)
        features = torch.empty(n, count * self.hidden) if count else None
        wanted = (ctypes.c_int64 * max(count, 1))(*feature_layers)
        if parents is not None:
            parents = parents.to(torch.int64).contiguous()
            if parents.shape != (n,):
                raise ValueError(f"parents must hold one row index per row ({n})")
        step = KStep(x.data_ptr(), n, start, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                     values.data_ptr(), keys.shape[2],
                     None if features is None else features.data_ptr(),
                     ctypes.addressof(wanted), count,
                     None if parents is None else parents.data_ptr())
        status = self._run(ctypes.byref(self._model), ctypes.byref(step),
                           torch.get_num_threads())
        if status == -1:
            raise MemoryError("the native decoder stack could not allocate its scratch memory")
        if status:
            raise ValueError(f"the native decoder stack refused its shapes ({status})")
        return features
