"""``RowAttention``: the native ``attend_rows`` and ``attend_tree`` (``attention.c``) as a
callable over torch tensors, for the Python loop over layers (the native decoder stack calls
them itself)."""

from __future__ import annotations

import ctypes

import torch

from localspec.runtime.kernels.abi import MAX_HEAD_DIM, MAX_SHARED


class RowAttention:
    """Attention of new query rows over a bfloat16 KV cache, each row over exactly the keys it
    may see and bit for bit the same whatever the number of rows (what per-row SDPA calls
    gave, at about a third of their cost: one call per layer instead of one per row). Only for
    shapes it takes (``fits``)."""

    def __init__(self, lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int,
                 scale: float) -> None:
        self._kernel, self._tree = lib.attend_rows, lib.attend_tree
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale

    @staticmethod
    def fits(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """The kernel's limits: a bf16 cache, head_dim % 32 == 0 and <= MAX_HEAD_DIM, at most
        MAX_SHARED query heads per key-value head."""
        return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM
                and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MAX_SHARED)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 start: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        """q [heads, n, head_dim] float32 at positions start..start+n-1; keys and values
        [kv_heads, capacity, head_dim] bf16 holding them at rows start..; returns
        [n, heads * head_dim]. ``parents`` [n] int64 (parents[0] == -1, parents[j] < j): the
        rows form a tree and each attends the prefix, then its root path (``attend_tree``)."""
        q = q.float().contiguous()
        n = q.shape[1]
        if keys.shape != values.shape or not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("keys and values must be contiguous and of one shape")
        if start + n > keys.shape[1]:  # the kernel would read past the cache
            raise ValueError(f"positions up to {start + n} but the cache holds {keys.shape[1]}")
        out = torch.empty(n, self.heads * self.head_dim)
        shape = (self.heads, self.kv_heads, self.head_dim, self.scale, out.data_ptr(),
                 torch.get_num_threads())
        if parents is None:
            status = self._kernel(q.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                  keys.shape[1], start, n, *shape)
        else:
            parents = parents.to(torch.int64).contiguous()
            if parents.shape != (n,):
                raise ValueError(f"parents must hold one row index per row ({n})")
            status = self._tree(q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[1],
                                start, n, parents.data_ptr(), *shape)
        if status == -2:
            raise ValueError("the attention kernel refused the shape, or the tree's parents "
                             "(-1 for row 0, then earlier rows)")
        if status:
            raise MemoryError("the attention kernel could not allocate its scratch memory")
        return out
