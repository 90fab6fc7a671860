"""Native CPU kernels for the quantized forward, in C, built on first use with the system's C
compiler and loaded with ctypes.

Why a kernel of our own: on a 2-core CPU a decode step reads every weight once, so its time is
the bytes read. The built-in target's GGUF stores most matrices as Q4_K (4.5 bits a weight);
served as int8 it reads 1.8x the bytes. PyTorch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) takes float activations and costs several times more at 16
rows than at one, which ruins verification, and torchao's W4A8 CPU kernels are not in its PyPI
wheel. So ``kquant_matmul.c`` multiplies Q4_K weights, exactly as the file holds them, by
int8 activations, flat up to several rows and bit-identical whatever the number of rows; it
does the same for the file's Q6_K matrices (the LM head, half the v and down projections of a
Q4_K_M file), which int8 would read at 8 bits instead of 6.6. ``attention.c`` attends new rows (a
chain, or a draft tree) over a bf16 KV cache (``RowAttention``) and ``decoder_stack.c`` runs
the whole decoder stack in one call (``decoder_forward``, used by
``localspec.runtime.native``): with the matrices this fast, the tensor calls between them from
Python would be a sizeable share of a step (docs/research-log.md).

Modules: ``library`` builds and loads the library (variants, CPU features, the cache),
``abi`` mirrors its C interface for ctypes and checks it, ``row_attention`` wraps
``attend_rows`` and ``attend_tree``, ``kquant_formats`` holds the Q4_K / Q5_K / Q6_K weight
formats (parse, quantize, pack) and ``q32_formats`` the Q8_0 / Q4_0 ones. Where no variant can
be built, ``load_kernels`` says why and callers keep the oneDNN int8 path. The names below are
the package's public interface.
"""

from localspec.runtime.kernels.kquant_formats import (
    BLOCK_ROWS,
    GROUP,
    Q4K_BLOCK_BYTES,
    Q4K_PACKED,
    Q6K_BLOCK_BYTES,
    Q6K_GROUP,
    Q6K_PACKED,
    SUPER,
    Q3MWeights,
    Q4KWeights,
    Q5KWeights,
    Q6KWeights,
    cat_rows,
    pack_q3m,
    pack_q4k,
    pack_q5k,
    pack_q6k,
    parse_q4k,
    parse_q5k,
    parse_q6k,
    quantize_q3m,
    quantize_q4k,
    quantize_q5k,
    quantize_q6k,
    unpack_q6k,
)
from localspec.runtime.kernels.library import (
    KERNELS_ENV,
    VARIANTS,
    KernelUnavailable,
    cpu_features,
    load_kernels,
    pick_variant,
    runnable_variants,
    serving_kernels,
)
from localspec.runtime.kernels.q32_formats import (
    KQuantWeights,
    Q4_0Weights,
    Q8_0Weights,
    pack_q4_0,
    pack_q8_0,
    parse_q4_0,
    parse_q8_0,
    quantize_q4_0,
    quantize_q8_0,
)
from localspec.runtime.kernels.row_attention import RowAttention

__all__ = [
    "BLOCK_ROWS", "GROUP", "KERNELS_ENV", "Q4K_BLOCK_BYTES", "Q4K_PACKED", "Q6K_BLOCK_BYTES",
    "Q6K_GROUP", "Q6K_PACKED", "SUPER", "VARIANTS", "KQuantWeights", "KernelUnavailable",
    "Q3MWeights", "Q4KWeights", "Q4_0Weights", "Q5KWeights", "Q6KWeights", "Q8_0Weights",
    "RowAttention", "cat_rows", "cpu_features", "load_kernels", "pack_q3m", "pack_q4_0",
    "pack_q4k", "pack_q5k", "pack_q6k", "pack_q8_0", "parse_q4_0", "parse_q4k", "parse_q5k",
    "parse_q6k", "parse_q8_0", "pick_variant", "quantize_q3m", "quantize_q4_0", "quantize_q4k",
    "quantize_q5k", "quantize_q6k", "quantize_q8_0", "runnable_variants", "serving_kernels",
    "unpack_q6k",
]
