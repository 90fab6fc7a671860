"""``bench --bandwidth``: how close each native kernel comes to this machine's memory bandwidth.

A one-token decode step reads every weight once, so on a CPU its time is bytes over bandwidth.
This measures both in one process: the machine's read bandwidth as a torch sum over a 2 GiB
buffer (all threads; best of several, as a kernel pass below), then, for each GGUF type the
native kernels serve and for Q3_M (a draft's 3-bit form), a "pass": one input row through the
linear layers of a model shaped like the built-in 1.5B (28 layers of q/k/v, o, gate/up and down
projections; random weights of that type, each layer's its own copy, so they stream from memory
and not from cache), timed best of ``passes``. The result per type: milliseconds a pass, GB/s
read, and the percentage of the measured bandwidth. Also the same pass at 8 and 16 rows (a
verify pass), where the kernels turn compute-bound.

Weights are packed once per shape from ``quantize_*`` of random floats, then cloned per layer:
what is timed reads exactly the bytes a real model of that type reads (the LM head and the
attention over the KV cache, which are not here, add their own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localspec.models.cache import kernel_dir
from localspec.runtime.kernels import (
    quantize_q3m,
    quantize_q4k,
    quantize_q5k,
    quantize_q6k,
    serving_kernels,
)
from localspec.runtime.kernels.library import built_variant
from localspec.runtime.kernels.q32_formats import quantize_q4_0, quantize_q8_0
from localspec.runtime.quant import (
    Q3MLinear,
    Q4_0Linear,
    Q4KLinear,
    Q5KLinear,
    Q6KLinear,
    Q8_0Linear,
)

# The 1.5B's per-layer projections as the native stack fuses them: [out, in].
LAYER_SHAPES = ((1536 + 2 * 256, 1536), (1536, 1536), (2 * 8960, 1536), (1536, 8960))
LAYERS = 28
SUM_BYTES = 2 << 30
ROWS = (1, 8, 16)
TYPES: dict[str, tuple[type[Q4KLinear], Callable[[torch.Tensor], object]]] = {
    "Q4_K": (Q4KLinear, quantize_q4k),
    "Q5_K": (Q5KLinear, quantize_q5k),
    "Q6_K": (Q6KLinear, quantize_q6k),
    "Q8_0": (Q8_0Linear, quantize_q8_0),
    "Q4_0": (Q4_0Linear, quantize_q4_0),
    "Q3_M": (Q3MLinear, quantize_q3m),
}


@dataclass(frozen=True)
class TypeResult:
    """One type's passes: bytes read, best seconds per pass by row count."""

    name: str
    nbytes: int
    seconds: dict[int, float]

    def gbps(self, rows: int = 1) -> float:
        return self.nbytes / self.seconds[rows] / 1e9


def _best(run: Callable[[], object], repeats: int) -> float:
    run()  # warm: first touch, OpenMP's threads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(repeats: int = 5) -> float:
    """This machine's read bandwidth in GB/s: a torch sum over ``SUM_BYTES``, best of
    ``repeats``."""
    buffer = torch.ones(SUM_BYTES // 4)
    return SUM_BYTES / _best(buffer.sum, repeats) / 1e9


def _layers(kind: type[Q4KLinear], quantize: Callable[[torch.Tensor], object],
            lib: object, generator: torch.Generator) -> list[Q4KLinear]:
    shaped = []
    for n, k in LAYER_SHAPES:
        weights = quantize(torch.randn(n, k, generator=generator) * 0.02)
        shaped.append(kind.from_weights(weights, None, lib).packed)
    return [kind({name: t.clone() for name, t in packed.items()}, None, lib)
            for _ in range(LAYERS) for packed in shaped]


def measure_type(name: str, repeats: int = 5, seed: int = 0) -> TypeResult:
    """The passes of ``name`` (a key of ``TYPES``) at each of ``ROWS``."""
    kind, quantize = TYPES[name]
    lib = serving_kernels(kernel_dir())
    layers = _layers(kind, quantize, lib, torch.Generator().manual_seed(seed))
    nbytes = sum(t.numel() * t.element_size() for layer in layers for t in layer.packed.values())
    inputs = {k: {rows: torch.randn(rows, k) for rows in ROWS} for _, k in LAYER_SHAPES}

    def run(rows: int) -> Callable[[], None]:
        def one_pass() -> None:
            for layer in layers:
                layer(inputs[layer.in_features][rows])
        return one_pass

    seconds = {rows: _best(run(rows), repeats) for rows in ROWS}
    return TypeResult(name, nbytes, seconds)


def run_bandwidth(repeats: int = 5, log: Callable[[str], None] = print) -> str:
    """Measure the bandwidth and every type; the table as text."""
    variant = built_variant(serving_kernels(kernel_dir()))
    bandwidth = read_bandwidth(repeats)
    log(f"read bandwidth: {bandwidth:.1f} GB/s (torch sum over 2 GiB, "
        f"{torch.get_num_threads()} threads)")
    results = []
    for name in TYPES:
        results.append(measure_type(name, repeats))
        log(f"{name}: {results[-1].seconds[1] * 1e3:.1f} ms a pass")
    lines = [f"kernels: {variant}, {torch.get_num_threads()} threads; read bandwidth "
             f"{bandwidth:.1f} GB/s; a pass: one row through 28 layers of the 1.5B's shapes",
             "",
             "| type | MB read | 1 row | GB/s | % of bandwidth | 8 rows | 16 rows |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.nbytes / 1e6:.0f} | {r.seconds[1] * 1e3:.1f} ms | "
                     f"{r.gbps():.1f} | {100 * r.gbps() / bandwidth:.0f}% | "
                     f"{r.seconds[8] * 1e3:.1f} ms | {r.seconds[16] * 1e3:.1f} ms |")
    return "\n".join(lines)
