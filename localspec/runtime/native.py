"""The whole decoder stack in one native call (``decoder_forward_batch`` in
``kernels/decoder_stack.c``), over one sequence's rows or several sequences' at once (each
with its own cache: the parallel requests of ``localspec serve --parallel``).

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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class StackRows:
    """One sequence's rows in a ``NativeStack`` call: how many, their cos and sin [n,
    head_dim] (at each row's position), its cache's keys and values, the position of its
    first row, the layers whose input it records, and its tree (``parents``; None: a chain)."""

    n: int
    cos: torch.Tensor
    sin: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    start: int
    feature_layers: tuple[int, ...] = ()
    parents: torch.Tensor | None = None


class NativeStack:
    """``CpuDecoder``'s layers as ``decoder_forward`` takes them (``KModel``, checked against
    the library by ``abi.mismatch`` when it was loaded); the tensors stay owned by the
    decoder's layers (and the norms kept here), so they outlive every call."""

    def __init__(self, lib: ctypes.CDLL, layers: ctypes.Array, norms: list[torch.Tensor],
                 shape: tuple[int, int, int, int, int], eps: float, scale: float) -> None:
        self._run_batch = lib.decoder_forward_batch
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
        return self.batch(x, [StackRows(x.shape[0], cos, sin, keys, values, start,
                                        tuple(feature_layers), parents)])[0]

    def batch(self, x: torch.Tensor, rows: Sequence[StackRows]) -> list[torch.Tensor | None]:
        """Every layer over several sequences' rows at once: x [sum of n, hidden] float32 holds
        ``rows[0]``'s rows, then ``rows[1]``'s, ... (in place, as ``__call__``); each
        ``StackRows`` names its sequence's cache, positions, tree and features. The projections
        run over all rows together, attention over each sequence's own cache, and every row
        comes out bit for bit as its sequence fed alone. Returns each sequence's features."""
        total = sum(r.n for r in rows)
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[0] == total
                and rows):
            raise ValueError("decoder_forward needs contiguous float32 rows, one slice a "
                             "sequence")
        steps = (KStep * len(rows))()
        alive: list[object] = []  # what the steps point into, alive until the call returns
        outputs: list[torch.Tensor | None] = []
        at = 0
        for step, r in zip(steps, rows, strict=True):
            keys, values = r.keys, r.values
            if not (keys.is_contiguous() and values.is_contiguous()) or \
                    r.start + r.n > keys.shape[2]:
                raise ValueError("decoder_forward needs contiguous caches with room")
            cos, sin = r.cos.float().contiguous(), r.sin.float().contiguous()
            count = len(r.feature_layers)
            features = torch.empty(r.n, count * self.hidden) if count else None
            wanted = (ctypes.c_int64 * max(count, 1))(*r.feature_layers)
            parents = r.parents
            if parents is not None:
                parents = parents.to(torch.int64).contiguous()
                if parents.shape != (r.n,):
                    raise ValueError(f"parents must hold one row index per row ({r.n})")
            alive += [cos, sin, wanted, parents]
            step.x = x.data_ptr() + at * self.hidden * x.element_size()
            step.n, step.start = r.n, r.start
            step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
            step.keys, step.values, step.capacity = (keys.data_ptr(), values.data_ptr(),
                                                     keys.shape[2])
            step.features = None if features is None else features.data_ptr()
            step.feature_layers, step.count = ctypes.addressof(wanted), count
            step.parents = None if parents is None else parents.data_ptr()
            outputs.append(features)
            at += r.n
        status = self._run_batch(ctypes.byref(self._model), steps, len(rows),
                                 torch.get_num_threads())
        if status == -1:
            raise MemoryError("the native decoder stack could not allocate its scratch memory")
        if status:
            raise ValueError(f"the native decoder stack refused its shapes ({status})")
        return outputs
