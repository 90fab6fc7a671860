"""The native attention of new rows over a bf16 KV cache (``attention.c``, ``RowAttention``).

What speculation needs from it: each row attends over exactly the keys up to its own position,
and a row's output is bit for bit the same whatever other rows share the call and however many
threads run. Every test runs on the kernels this machine serves and on the portable build (a
machine where neither builds fails here, ``kernel_helpers.kernel_lib``).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_helpers import attention_inputs, attention_reference

from localspec.runtime.kernels import RowAttention


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(12, 2, 128), (14, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["soft", "peaked"])
def test_row_attention_matches_causal_attention(lib: ctypes.CDLL, heads: int, kv_heads: int,
                                                d: int, spread: float) -> None:
    """Each row attends over exactly the keys up to its own position (the Qwen2.5 1.5B's and
    0.5B's shapes, and heads without sharing), with float32 error only; peaked scores put
    most weights far below exp's range, which must give 0, never NaN."""
    scale = d ** -0.5
    q, keys, values = attention_inputs(heads, kv_heads, d, capacity=320, n=21, seed=d,
                                       spread=spread)
    attention = RowAttention(lib, heads, kv_heads, d, scale)
    for start in (0, 5, 16, 290):
        out = attention(q, keys, values, start)
        expected = attention_reference(q, keys, values, start, scale)
        assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5), start


def test_row_attention_rows_do_not_depend_on_the_batch(lib: ctypes.CDLL) -> None:
    """Row j of a call over n rows at ``start`` is bit for bit the one-row call at start + j,
    with 1 or 2 threads, around the 16-key blocks the kernel works in: what keeps a verify
    pass equal to one-token steps."""
    q, keys, values = attention_inputs(12, 2, 128, capacity=256, n=20, seed=3)
    attention = RowAttention(lib, 12, 2, 128, 0.088)
    for start in (0, 11, 31, 200):
        rows = torch.cat([attention(q[:, j:j + 1], keys, values, start + j) for j in range(20)])
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(attention(q, keys, values, start), rows), (start, threads)
            finally:
                torch.set_num_threads(previous)


def test_row_attention_refuses_what_it_cannot_take(lib: ctypes.CDLL) -> None:
    """Positions past the cache are an error before the kernel could read past it; shapes
    outside its limits are not ``fits``, and the kernel itself refuses them (-2) rather than
    reading out of bounds."""
    q, keys, values = attention_inputs(4, 2, 32, capacity=16, n=4, seed=1)
    with pytest.raises(ValueError, match="cache holds 16"):
        RowAttention(lib, 4, 2, 32, 0.2)(q, keys, values, start=13)
    assert RowAttention.fits(12, 2, 128, torch.bfloat16)
    assert not RowAttention.fits(12, 2, 128, torch.float32)  # the cache must be bf16
    assert not RowAttention.fits(4, 2, 8, torch.bfloat16)  # head_dim % 32
    assert not RowAttention.fits(40, 2, 64, torch.bfloat16)  # 20 heads share one
    assert not RowAttention.fits(4, 0, 64, torch.bfloat16)
    out = torch.empty(4 * 48)
    for heads, kv_heads, d in ((4, 2, 48), (40, 2, 64), (4, 0, 32), (3, 2, 32)):
        assert lib.attend_rows(q.data_ptr(), keys.data_ptr(), values.data_ptr(), 16, 0, 1,
                               heads, kv_heads, d, 0.2, out.data_ptr(), 1) == -2


def random_tree(n: int, seed: int) -> list[int]:
    """Parents of a random tree of n rows: -1 for the root, then each an earlier row."""
    generator = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, n)]


def root_path(parents: list[int], j: int) -> list[int]:
    """Row j's root path, root first."""
    path = [j]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(12, 2, 128), (14, 2, 64), (4, 4, 32)])
def test_tree_rows_equal_their_root_paths_fed_as_chains(lib: ctypes.CDLL, heads: int,
                                                        kv_heads: int, d: int) -> None:
    """Each row of a tree attends the prefix, then its root path in depth order: its output is
    bit for bit the last row of that path fed alone as a chain at the same start (the cache
    holding the path's keys at start..), at starts around the 16-key blocks, with 1 or 2
    threads; a chain's parents give attend_rows' bits."""
    n = 9
    q, keys, values = attention_inputs(heads, kv_heads, d, capacity=80, n=n, seed=d)
    attention = RowAttention(lib, heads, kv_heads, d, d ** -0.5)
    for seed, start in enumerate((0, 5, 15, 16, 31, 44)):
        parents = random_tree(n, seed)
        assert len({len(root_path(parents, j)) for j in range(n)}) > 2  # a real tree
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                tree = attention(q, keys, values, start, torch.tensor(parents))
            finally:
                torch.set_num_threads(previous)
            for j in range(n):
                path = root_path(parents, j)
                chain_keys, chain_values = keys.clone(), values.clone()
                rows = torch.tensor(path) + start
                chain_keys[:, start:start + len(path)] = keys[:, rows]
                chain_values[:, start:start + len(path)] = values[:, rows]
                chain = attention(q[:, path], chain_keys, chain_values, start)
                assert torch.equal(tree[j], chain[-1]), (start, j, threads)
        straight = torch.tensor([-1, *range(n - 1)])
        assert torch.equal(attention(q, keys, values, start, straight),
                           attention(q, keys, values, start))


def test_tree_attention_refuses_parents_that_are_no_tree(lib: ctypes.CDLL) -> None:
    """A root with a parent, a parent at or after its child, or the wrong count: a ValueError,
    never a read outside the rows."""
    q, keys, values = attention_inputs(4, 2, 32, capacity=16, n=3, seed=1)
    attention = RowAttention(lib, 4, 2, 32, 0.2)
    for parents in ([0, 0, 1], [-1, 1, 0], [-1, 0, 3], [-1, 0], [-1, -1, 0]):
        with pytest.raises(ValueError, match="parents"):
            attention(q, keys, values, 2, torch.tensor(parents))
