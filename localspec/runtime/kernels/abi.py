"""The native kernels' C interface as ctypes sees it, and the check that a loaded library has it.

ctypes cannot read C headers, so the structs of ``kernels.h`` (``KPart``, ``KFused``,
``KLayer``, ``KModel``, ``KStep``) and the functions' signatures are written a second time here.
A mismatch would corrupt memory without an error, so nothing is called before ``mismatch``
has compared the library's own report with this mirror: its ABI version (bumped with any
change to a signature), its variant, and ``kernels_layout``'s text of the constants, struct
sizes and field offsets, which this module renders the same way from ctypes.
"""

from __future__ import annotations

import ctypes

from localspec.runtime.kernels.kquant_formats import (
    BLOCK_ROWS,
    GROUP,
    Q3M_PACKED,
    Q4K_BLOCK_BYTES,
    Q4K_PACKED,
    Q5K_BLOCK_BYTES,
    Q5K_PACKED,
    Q6K_BLOCK_BYTES,
    Q6K_PACKED,
    SUPER,
)
from localspec.runtime.kernels.q32_formats import (
    Q4_0_BLOCK_BYTES,
    Q4_0_PACKED,
    Q8_0_BLOCK_BYTES,
    Q8_0_PACKED,
)

ABI_VERSION = 6  # kernels.h's KERNELS_ABI_VERSION
# KPart kinds (kernels.h): ggml's type numbers for the legacy types, the bits for k-quants;
# Q3_M (LocalSpec's own, no GGUF type) a number outside ggml's range
KIND_Q4_0, KIND_Q4_K, KIND_Q5_K, KIND_Q6_K, KIND_Q8_0, KIND_Q3_M = 2, 4, 5, 6, 8, 103
MAX_PARTS = 4  # linear layers side by side in one fused projection
MAX_HEAD_DIM = 256  # attend_rows' limits
MAX_SHARED = 16  # query heads per key-value head

_pointer, _size, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class KPart(ctypes.Structure):
    """One quantized matrix of n rows (its KIND_*): its packed tensors, its bias."""

    _fields_ = [("kind", _size), ("n", _size), ("t", _pointer * 5), ("bias", _pointer)]


class KFused(ctypes.Structure):
    """Matrices side by side in one projection (q|k|v, gate|up)."""

    _fields_ = [("parts", _size), ("part", KPart * MAX_PARTS)]


class KLayer(ctypes.Structure):
    """One decoder layer: its two norms' weights, Qwen3's per-head query and key norms (NULL
    where a model has none) and four projections."""

    _fields_ = [("norm1", _pointer), ("norm2", _pointer), ("q_norm", _pointer),
                ("k_norm", _pointer), ("qkv", KFused), ("o", KFused),
                ("gate_up", KFused), ("down", KFused)]


class KModel(ctypes.Structure):
    """A model's layers and shape, as ``decoder_forward`` takes them."""

    _fields_ = [("layers", _pointer), ("n_layers", _size), ("hidden", _size), ("heads", _size),
                ("kv_heads", _size), ("head_dim", _size), ("intermediate", _size),
                ("eps", _float), ("scale", _float)]


class KStep(ctypes.Structure):
    """One ``decoder_forward`` call's rows, positions, cache and requested features."""

    _fields_ = [("x", _pointer), ("n", _size), ("start", _size), ("cos", _pointer),
                ("sin", _pointer), ("keys", _pointer), ("values", _pointer),
                ("capacity", _size), ("features", _pointer), ("feature_layers", _pointer),
                ("count", _size), ("parents", _pointer)]


# name -> (restype, argtypes), as kernels.h declares them
FUNCTIONS: dict[str, tuple[type, list[type]]] = {
    # x, rows, width, the packed tensors (Q4K_PACKED / Q6K_PACKED), n, y, threads
    "q4k_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q4K_PACKED), _size,
                          _pointer, _int]),
    "q6k_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q6K_PACKED), _size,
                          _pointer, _int]),
    "q5k_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q5K_PACKED), _size,
                          _pointer, _int]),
    "q3m_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q3M_PACKED), _size,
                          _pointer, _int]),
    "q8_0_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q8_0_PACKED), _size,
                           _pointer, _int]),
    "q4_0_linear": (_int, [_pointer, _size, _size, *[_pointer] * len(Q4_0_PACKED), _size,
                           _pointer, _int]),
    # q, keys, values, capacity, start, n, heads, kv_heads, head_dim, scale, out, threads
    "attend_rows": (_int, [_pointer, _pointer, _pointer, *[_size] * 6, _float, _pointer,
                           _int]),
    # the same with parents (the tree's, after n) before heads
    "attend_tree": (_int, [_pointer, _pointer, _pointer, *[_size] * 3, _pointer, *[_size] * 3,
                           _float, _pointer, _int]),
    "decoder_forward": (_int, [ctypes.POINTER(KModel), ctypes.POINTER(KStep), _int]),
    # model, an array of steps, their count, threads
    "decoder_forward_batch": (_int, [ctypes.POINTER(KModel), ctypes.POINTER(KStep), _size,
                                     _int]),
    "kernels_rows_per_pass": (_size, []),
}
_STRUCTS = (KPart, KFused, KLayer, KModel, KStep)


def expected_layout() -> str:
    """``kernels_layout``'s text for the constants and structs this side relies on."""
    constants = {"BLOCK_ROWS": BLOCK_ROWS, "GROUP": GROUP, "SUPER": SUPER,
                 "MAX_PARTS": MAX_PARTS, "MAX_HEAD_DIM": MAX_HEAD_DIM, "MAX_SHARED": MAX_SHARED,
                 "sizeof(GgufBlockQ4K)": Q4K_BLOCK_BYTES, "sizeof(GgufBlockQ6K)": Q6K_BLOCK_BYTES,
                 "sizeof(Q4KGroup)": BLOCK_ROWS * GROUP // 2,
                 "sizeof(Q6KTop)": BLOCK_ROWS * GROUP // 4,
                 "sizeof(GgufBlockQ5K)": Q5K_BLOCK_BYTES, "sizeof(GgufBlockQ8_0)": Q8_0_BLOCK_BYTES,
                 "sizeof(GgufBlockQ4_0)": Q4_0_BLOCK_BYTES,
                 "sizeof(Q5KGroup)": BLOCK_ROWS * GROUP * 5 // 8,
                 "sizeof(Q8Group)": BLOCK_ROWS * GROUP,
                 "sizeof(Q3MGroup)": BLOCK_ROWS * GROUP * 3 // 8, "KIND_Q4_0": KIND_Q4_0,
                 "KIND_Q4_K": KIND_Q4_K, "KIND_Q5_K": KIND_Q5_K, "KIND_Q6_K": KIND_Q6_K,
                 "KIND_Q8_0": KIND_Q8_0, "KIND_Q3_M": KIND_Q3_M}
    text = "".join(f"{name}={value};" for name, value in constants.items())
    for struct in _STRUCTS:
        fields = "".join(f" {name}@{getattr(struct, name).offset}" for name, *_ in struct._fields_)
        text += f"{struct.__name__}={ctypes.sizeof(struct)}{fields};"
    return text


def mismatch(lib: ctypes.CDLL, variant: str) -> str | None:
    """Why ``lib`` is not a build of these kernels' ``variant`` with this interface (None when
    it is); on None, every function of FUNCTIONS has its ctypes signature."""
    try:
        version, name, layout = (lib.kernels_abi_version, lib.kernels_variant,
                                 lib.kernels_layout)
    except AttributeError:
        return "it exports no kernels_abi_version: it is not a build of these kernels"
    version.restype, version.argtypes = _size, []
    name.restype, name.argtypes = ctypes.c_char_p, []
    layout.restype, layout.argtypes = _size, [ctypes.c_char_p, _size]
    if version() != ABI_VERSION:
        return f"its ABI version is {version()}, this LocalSpec's is {ABI_VERSION}"
    built = (name() or b"").decode(errors="replace")
    if built != variant:
        return f"it is the {built!r} variant, not {variant!r}"
    size = layout(None, 0) + 1
    buffer = ctypes.create_string_buffer(size)
    layout(buffer, size)
    theirs, ours = buffer.value.decode(errors="replace"), expected_layout()
    if theirs != ours:
        return f"its layout differs from the ctypes mirror's:\n  C:      {theirs}\n  ctypes: {ours}"
    missing = [f for f in FUNCTIONS if not hasattr(lib, f)]
    if missing:
        return f"it lacks {', '.join(missing)}"
    for function, (restype, argtypes) in FUNCTIONS.items():
        getattr(lib, function).restype = restype
        getattr(lib, function).argtypes = argtypes
    return None
