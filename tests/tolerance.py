"""Float tolerances that the arithmetic can promise on any CPU.

Two computations of the same values agree bit for bit only when they run the same kernels on
the same shapes; a test then compares with ``torch.equal``. Anything else (another CPU's SIMD
width, another matrix shape and so another blocking, another library's softmax) may round
differently, and a tolerance must cover what rounding can do, not what one machine measured.
The bounds here follow Higham, *Accuracy and Stability of Numerical Algorithms* (ch. 3), with
``u`` the unit roundoff of the dtype the arithmetic runs in (half its machine epsilon):

- ``matmul_bound``: a dot product of length n, summed in any order, with or without fused
  multiply-adds, is within ``gamma_n * sum |a_i b_i|`` of the exact value, where
  ``gamma_n = n u / (1 - n u)``. Two such evaluations are within twice that of each other.
  Elementwise and rigorous: it depends only on the inputs, never on the kernel.
- ``forward_atol``: a whole forward (norms, attention, MLPs over several layers) has no
  rigorous bound small enough to test with; it takes the same shape, epsilon x the longest
  reduction x the size of the values compared. Rounding errors have random signs and grow
  like sqrt(n) (Higham and Mary, 2019), so the n here leaves room for the layers' compounding.
- ``normalised_rtol`` and ``sum_to_one_atol``: a sum of n non-negative terms is within
  ``gamma_n`` of exact, relatively, so values divided by their own sum (probabilities) are
  within ``gamma_n + u`` of exact, and their float sum within ``2 gamma_n + u`` of 1,
  whatever errors the values had before (a softmax's exponentials cancel in the quotient).

These are for float rounding only: quantization steps, sampling noise and approximations
(a w8a8 model against its float original) have bounds of their own, stated where used.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u: the largest relative error of one rounding to ``dtype`` (half its epsilon)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained roundings."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1.0:
        raise ValueError(f"n = {n} roundings in {dtype} bound nothing (n u >= 1)")
    return nu / (1.0 - nu)


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32,
                 evaluations: int = 2) -> torch.Tensor:
    """Elementwise bound on how far apart two evaluations of ``a @ b.T`` can be (a [m, n],
    b [k, n]; result [m, k]) in ``dtype`` arithmetic: ``2 gamma_n |a| @ |b|.T``.
    ``evaluations=1``: the distance of one evaluation from the exact product."""
    a64, b64 = a.detach().double(), b.detach().double()
    return evaluations * gamma(a.shape[-1], dtype) * (a64.abs() @ b64.abs().T)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float
                  ) -> None:
    """|actual - expected| <= bound elementwise (in float64); the message names the worst
    element and its bound."""
    difference = (actual.detach().double() - expected.detach().double()).abs()
    bound = torch.as_tensor(bound).detach().double().expand_as(difference)
    excess = difference - bound
    worst = int(excess.argmax())
    assert float(excess.flatten()[worst]) <= 0.0, (
        f"|difference| {float(difference.flatten()[worst]):.3g} > bound "
        f"{float(bound.flatten()[worst]):.3g} at flat index {worst}")


def forward_atol(reference: torch.Tensor, reduction: int,
                 dtype: torch.dtype = torch.float32) -> float:
    """An absolute tolerance for two forwards of one network computed differently:
    ``eps(dtype) * reduction * max |reference|``, with ``reduction`` the longest sum in the
    network (hidden size, MLP width, or positions attended)."""
    return torch.finfo(dtype).eps * reduction * float(reference.detach().abs().max())


def normalised_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error of n non-negative values divided by their own float sum:
    ``gamma_n`` for the sum plus one rounding for the quotient."""
    return gamma(n, dtype) + unit_roundoff(dtype)


def sum_to_one_atol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """How far the float sum of n values normalised by their own sum (a row of
    probabilities) may be from 1: ``normalised_rtol`` plus ``gamma_n`` for summing them."""
    return normalised_rtol(n, dtype) + gamma(n, dtype)
