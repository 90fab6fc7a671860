"""A GGUF file's header: its metadata and tensor table, read without touching the weights.

The ``gguf`` package's ``GGUFReader`` parses every array element into a Python object of its
own, so opening the built-in 1.5B's header (151,936 tokens and as many merges) takes many
seconds; the model library lists many files and wants milliseconds. This reader walks the same
format (GGUF v2 and v3, little-endian: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
with ``struct`` over a memory map, keeps scalars and the arrays asked for, skips the rest, and
takes the types' names and block sizes from the ``gguf`` package, so no table is copied here.

It checks what a listing must not trust: the magic and version, every length against the
file's size (a damaged count cannot make it allocate gigabytes), and that every tensor's data
lies inside the file, which is how a truncated download shows. Each failure is a
``ModelLoadError`` naming the file and what is wrong. Torch-free.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from localspec.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# The first read of a header split in parts (the built-in Qwen's, with its 151,936-token
# vocabulary, is ~7 MB)
HEADER_FIRST_READ = 1 << 24
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    type_name: str  # "Q4_K", "F32", ... (a number, as text, for a type this gguf does not know)
    shape: tuple[int, ...]  # as GGUF stores it: the fastest-varying dimension first
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A file's metadata (scalars, and the arrays asked for) and tensor table."""

    path: Path
    version: int
    fields: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", "unknown"))

    def arch_field(self, key: str) -> object:
        """``<architecture>.<key>`` (``context_length``, ``block_count``, ...), or None."""
        return self.fields.get(f"{self.architecture}.{key}")


class _Cursor:
    """Reads little-endian values from a buffer, refusing to run past its end."""

    def __init__(self, buffer: mmap.mmap | bytes, where: Path) -> None:
        self.buffer, self.where, self.pos = buffer, where, 0

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if size < 0 or end > len(self.buffer):
            raise ModelLoadError(f"{self.where}: not a complete GGUF file: its header runs past "
                                 f"the end of the file ({len(self.buffer):,} bytes); truncated "
                                 "or damaged: download or copy it again")
        view = memoryview(self.buffer)[self.pos:end]
        self.pos = end
        return view

    def unpack(self, fmt: str) -> object:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(int(self.unpack("<Q"))))
        return raw.decode("utf-8", errors="replace")

    def count(self, what: str, item_bytes: int) -> int:
        """A 64-bit count of items of at least ``item_bytes`` each, checked against the bytes
        left (a damaged count must not allocate more than the file could hold)."""
        n = int(self.unpack("<Q"))
        if n * item_bytes > len(self.buffer) - self.pos:
            raise ModelLoadError(f"{self.where}: damaged GGUF header: {n:,} {what} cannot fit "
                                 f"in the {len(self.buffer):,}-byte file")
        return n


def _value(cursor: _Cursor, kind: int, keep: bool) -> object:
    """One metadata value of type ``kind``; an array is read whole only if ``keep``."""
    try:
        vtype = GGUFValueType(kind)
    except ValueError:
        raise ModelLoadError(f"{cursor.where}: damaged GGUF header: unknown value type {kind}"
                             ) from None
    if vtype == GGUFValueType.STRING:
        return cursor.string()
    if vtype in _SCALARS:
        return cursor.unpack(_SCALARS[vtype])
    item = GGUFValueType(int(cursor.unpack("<I")))  # ARRAY: item type, count, items
    size = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
    n = cursor.count("array items", size)
    if item in _SCALARS:
        view = cursor.take(n * size)
        return list(struct.unpack(f"<{n}{_SCALARS[item][1]}", view)) if keep else None
    if item == GGUFValueType.STRING:
        return _strings(cursor, n, keep)
    items = [_value(cursor, item, keep) for _ in range(n)]  # arrays of arrays: rare and short
    return items if keep else None


def _strings(cursor: _Cursor, n: int, keep: bool) -> list[str] | None:
    """``n`` strings in a row (a vocabulary: 151,936 of them), walked with ``unpack_from``:
    skipped ones are never copied or decoded."""
    buffer, pos, end = cursor.buffer, cursor.pos, len(cursor.buffer)
    items: list[str] = []
    for _ in range(n):
        if pos + 8 > end:
            break
        length = struct.unpack_from("<Q", buffer, pos)[0]
        if pos + 8 + length > end:
            break
        if keep:
            items.append(bytes(buffer[pos + 8:pos + 8 + length]).decode("utf-8", "replace"))
        pos += 8 + length
    else:
        cursor.pos = pos
        return items if keep else None
    cursor.pos = end
    cursor.take(1)  # past the end: the error a truncated header gets
    return None


def _tensor(cursor: _Cursor) -> TensorInfo:
    name = cursor.string()
    dims = int(cursor.unpack("<I"))
    if not 1 <= dims <= MAX_DIMS:
        raise ModelLoadError(f"{cursor.where}: damaged GGUF header: tensor {name!r} has {dims} "
                             "dimensions")
    shape = tuple(int(cursor.unpack("<Q")) for _ in range(dims))
    kind, offset = int(cursor.unpack("<I")), int(cursor.unpack("<Q"))
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        return TensorInfo(name, str(kind), shape, offset, 0)
    block, type_size = GGML_QUANT_SIZES[qtype]
    elements = 1
    for d in shape:
        elements *= d
    return TensorInfo(name, qtype.name, shape, offset, elements // block * type_size)


def read_gguf_header(path: Path, arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    """The header of the GGUF file at ``path``: every scalar field, the array fields named in
    ``arrays`` (others are skipped), and the tensor table; ModelLoadError if it is not a GGUF
    file, is damaged, or is shorter than its tensors need (truncated)."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse(buffer, path, size, arrays)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read the GGUF file: {exc.strerror or exc}"
                             ) from exc


def read_gguf_header_parts(parts: Sequence[Path], where: Path, size: int,
                           arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    """The header of a ``size``-byte GGUF file stored as consecutive ``parts`` (a built-in
    model's packages), from its first bytes only: listing or checking it needs no assembled copy.
    ``where`` names the file in messages. Reads ``HEADER_FIRST_READ`` bytes, then four times
    more while the header runs past what was read."""
    want = HEADER_FIRST_READ
    while True:
        head = bytearray()
        for part in parts:
            with part.open("rb") as f:
                head += f.read(want - len(head))
            if len(head) >= want:
                break
        try:
            return _parse(bytes(head), where, size, arrays)
        except ModelLoadError:
            if len(head) >= size or len(head) < want:  # all of it read: the damage is real
                raise
            want *= 4


def _parse(buffer: mmap.mmap | bytes, path: Path, size: int, arrays: frozenset[str]
           ) -> GGUFHeader:
    cursor = _Cursor(buffer, path)
    if bytes(cursor.take(4)) != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    version = int(cursor.unpack("<I"))
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not read here (2 and 3 are; a "
                             "huge number means a big-endian file): convert it again with a "
                             "current llama.cpp")
    n_tensors = cursor.count("tensors", 24)
    n_fields = cursor.count("metadata fields", 12)
    fields: dict[str, object] = {}
    for _ in range(n_fields):
        key = cursor.string()
        kind = int(cursor.unpack("<I"))
        fields[key] = _value(cursor, kind, keep=kind != GGUFValueType.ARRAY or key in arrays)
    tensors = tuple(_tensor(cursor) for _ in range(n_tensors))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: damaged GGUF header: alignment {alignment!r}")
    data_start = -(-cursor.pos // alignment) * alignment
    end = max((data_start + t.offset + t.nbytes for t in tensors), default=data_start)
    if end > size:
        raise ModelLoadError(f"{path}: truncated GGUF file: its tensors need {end:,} bytes, the "
                             f"file has {size:,}; download or copy it again")
    return GGUFHeader(path, version, fields, tensors, data_start, size)


def gguf_config(header: GGUFHeader) -> dict[str, object]:
    """The config.json facts that size a model (``hardware.Architecture.from_config``), read
    from a GGUF header: llama.cpp's ``<arch>.*`` keys and the token embedding's shape."""
    def number(key: str) -> object:
        value = header.arch_field(key)
        return max(value) if isinstance(value, list) and value else value  # per-layer lists

    shapes = {t.name: t.shape for t in header.tensors}
    hidden, heads = number("embedding_length"), number("attention.head_count")
    embedding = shapes.get("token_embd.weight", ())
    return {"model_type": header.architecture, "hidden_size": hidden,
            "intermediate_size": number("feed_forward_length"),
            "num_hidden_layers": number("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": number("attention.head_count_kv") or heads,
            "vocab_size": embedding[-1] if embedding else None,
            "tie_word_embeddings": "output.weight" not in shapes,
            "head_dim": number("attention.key_length"),
            "max_position_embeddings": number("context_length") or 0}
