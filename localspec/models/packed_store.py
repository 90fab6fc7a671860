"""The CPU forward's weights on disk (w8a8, w4a8): quantize once, then start from int8.

Quantizing the 1.5B target from bfloat16 takes about half a minute on 2 cores and passes 3 GB
of float temporaries through memory; reading its int8 tensors back takes a second. So the first
``w8a8`` (or ``w4a8``) load of a model saves what the CPU forward holds (int8 rows and
scales, packed Q4_K and Q6_K blocks, norms, the embedding) in ``<cache>/<kind>/<folder>-<key>/``,
keyed by the source folder's path and the size and modification time of its weight files (for
a GGUF model, its config-and-tokenizer folder: ``runtime.gguf_pack`` makes the pack from the file),
and every later start reads that instead; the
transformers model's own weights are then never touched. Tensors are read one at a time and
packed for oneDNN as they come (plain reads, no memory map), so memory holds the packed copy,
not the file as well. The token embedding is the exception: it is memory-mapped, because a
reply looks up a few thousand of its 151,936 rows and only those pages are ever read (0.7 GB
of the two built-in models' embeddings that need not be resident).

Every byte a start reads is checked. The folder's manifest (size, sampled-block fingerprint)
is checked first, as for every cached artefact; the file's metadata holds a CRC32 per tensor
(over its name, dtype, shape and bytes, so a damaged header entry counts too), and each tensor
is checked as it is read: the bytes are in memory then, and CRC32 costs a fraction of the read.
The memory-mapped embedding is read once through a small buffer for its check (~0.1-0.2 s for
the 1.5B's 0.47 GB, warm): its pages then sit in the page cache, not in this process, and a
check at each lookup would cost every reply instead. A tensor that fails its CRC32, a file
that fails its fingerprint, or one that safetensors cannot read is named in a warning, and the
folder is removed and packed again from the source weights. Not caught: damage after the check
(the embedding's pages are read from the file again when first looked up).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from localspec.config import ModelSpec, cache_root
from localspec.errors import ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import (
    GGUF_READ_ERRORS,
    Progress,
    assemble_builtin,
    builtin_gguf_path,
    kernel_dir,
    release_assembled,
)
from localspec.models.integrity import (
    MANIFEST_NAME,
    remove_stale_temps,
    verify_manifest,
    write_manifest,
    writer_tag,
)
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.gguf_kquants import unserved_message
from localspec.runtime.gguf_pack import fill_from_gguf
from localspec.runtime.kernels import KernelUnavailable, KQuantWeights, serving_kernels
from localspec.runtime.weight_formats import export_weights

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "packed-weights.safetensors"  # the same name in every kind's folder
# bump when the numbers a pack holds change (what export_weights computes): features and
# answers computed through them (training/target.py) are then stale too
NUMERICS = "3"
# bump when the file's names or layout change, or what is stored to check it: packs are rebuilt
FORMAT = "5"
_CRC_KEY = "crc32"  # metadata: JSON {tensor name: CRC32 of its name, dtype, shape and bytes}
_CHUNK = 8 * 1024 * 1024  # a memory-mapped tensor's check reads it in pieces of this size


def store_dir(folder: Path, kind: str = "w8a8") -> Path:
    """Where the ``kind`` weights of the model in ``folder`` are kept."""
    folder = folder.resolve()
    key = hashlib.sha256(f"{FORMAT}|{folder}".encode())
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        key.update(f"|{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return cache_root() / kind / f"{folder.name}-{key.hexdigest()[:12]}"


_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "I32": torch.int32}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class DamagedTensor(ValueError):
    """A stored tensor whose bytes or header entry are not the ones written."""


def _entry_crc(name: str, dtype: str, shape: list[int]) -> int:
    """CRC32 of a tensor's header entry; its bytes are added to it (``zlib.crc32(data, this)``),
    so that a damaged name, dtype or shape fails the check as damaged bytes do."""
    return zlib.crc32(f"{name}|{dtype}|{','.join(map(str, shape))}".encode())


def _tensor_crcs(weights: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The CRC32 of each tensor as ``save_file`` writes it (contiguous, little-endian)."""
    return {name: zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(),
                             _entry_crc(name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape)))
            for name, tensor in weights.items()}


class _FileTensors(Mapping[str, torch.Tensor]):
    """A safetensors file read one tensor at a time with plain reads, not a memory map: a map
    would keep every page read so far resident (and counted) until it is closed, on top of
    the packed copies being built from them. Every tensor handed out has passed its CRC32
    (``DamagedTensor`` if not)."""

    def __init__(self, path: Path, mapped: tuple[str, ...] = ()) -> None:
        """``mapped``: tensors given as read-only maps of the file instead of read in."""
        self._mapped = mapped
        self._file = path.open("rb")
        try:
            size = int.from_bytes(self._read(0, 8), "little")
            header = json.loads(self._read(8, size))
            self.metadata = header.pop("__metadata__", {})
            self._entries = {name: (e["dtype"], e["shape"], e["data_offsets"])
                             for name, e in header.items()}
            crcs = json.loads(self.metadata.get(_CRC_KEY, "{}"))
            self._crcs = {str(name): int(crc) for name, crc in crcs.items()}
        except BaseException:
            self._file.close()
            raise
        self._base = 8 + size

    def _read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._file.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"{self._file.name}: truncated")
        return data

    def _check(self, name: str, crc: int) -> None:
        if self._crcs.get(name) != crc:
            raise DamagedTensor(f"{Path(self._file.name).name}: tensor {name!r} fails its "
                                "CRC32 (damaged on disk)")

    def _mapped_crc(self, name: str, begin: int, end: int) -> int:
        """The CRC32 of a mapped tensor, read through one small buffer: none of the map's
        pages are touched, so the check leaves the file in the page cache, not in this process."""
        crc = _entry_crc(name, *self._entries[name][:2])
        buffer = numpy.empty(min(_CHUNK, end - begin), dtype=numpy.uint8)
        for offset in range(begin, end, _CHUNK):
            piece = buffer[:min(_CHUNK, end - offset)]
            if os.preadv(self._file.fileno(), [piece], self._base + offset) != len(piece):
                raise OSError(f"{self._file.name}: truncated")
            crc = zlib.crc32(piece, crc)
        return crc

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype_name, shape, (begin, end) = self._entries[name]
        dtype = _DTYPES[dtype_name]
        if name in self._mapped and end > begin:  # copy-on-write: never writes the file
            self._check(name, self._mapped_crc(name, begin, end))
            array = numpy.memmap(self._file.name, dtype=numpy.uint8, mode="c",
                                 offset=self._base + begin, shape=(end - begin,))
            return torch.from_numpy(array).view(dtype).reshape(shape)
        data = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin and os.preadv(self._file.fileno(), [data.numpy()],
                                     self._base + begin) != end - begin:
            raise OSError(f"{self._file.name}: truncated")
        self._check(name, zlib.crc32(data.numpy(), _entry_crc(name, dtype_name, shape)))
        return data.view(dtype).reshape(shape)

    def __contains__(self, name: object) -> bool:
        """Without reading the tensor (Mapping's own ``in`` would read and check it)."""
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._file.close()


def _save(weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write the folder atomically: a temp folder renamed into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f"{out_dir.name}.{writer_tag()}.",
                                suffix=".part"))
    try:
        weights = {k: v.contiguous() for k, v in weights.items()}
        save_file(weights, str(tmp / WEIGHTS_NAME),
                  metadata={"format": FORMAT, _CRC_KEY: json.dumps(_tensor_crcs(weights))})
        write_manifest(tmp / MANIFEST_NAME, [WEIGHTS_NAME])
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # folders of this model under another key (another format, or the source's files since
    # changed) are stale; a folder of the same name elsewhere loses its copy too, and is
    # quantized again when next loaded
    for old in out_dir.parent.glob(f"{glob.escape(out_dir.name.rsplit('-', 1)[0])}-*"):
        if old != out_dir and old.is_dir() and not old.name.endswith(".part"):
            shutil.rmtree(old, ignore_errors=True)


def _from_store(model: PreTrainedModel, out_dir: Path, kind: str,
                kernel_lib: object | None) -> CpuDecoder | None:
    """The decoder from a stored folder, or None (with the reason logged, and the folder
    removed: it is packed again) if it is unusable."""
    problem = verify_manifest(out_dir / MANIFEST_NAME)
    if problem is None:
        tensors = None
        try:
            tensors = _FileTensors(out_dir / WEIGHTS_NAME, mapped=("embed",))
            if tensors.metadata.get("format") == FORMAT:
                return CpuDecoder(model, kind, tensors, kernel_lib)
            problem = "another format"
        except DamagedTensor as exc:
            problem = str(exc)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            problem = f"unreadable ({exc.__class__.__name__}: {exc})"
        finally:
            if tensors is not None:
                tensors.close()
    if out_dir.exists():
        logger.warning("cached %s weights %s: %s; quantizing again", kind, out_dir, problem)
        shutil.rmtree(out_dir, ignore_errors=True)
    return None


def stored_decoder(model: PreTrainedModel, folder: Path, kind: str = "w8a8",
                   kernel_lib: object | None = None) -> CpuDecoder | None:
    """The ``kind`` CPU forward of the model in ``folder`` from its stored weights (``model``
    may be an emptied skeleton: only its config and rotary tables are used), or None."""
    return _from_store(model, store_dir(folder, kind), kind, kernel_lib)


def cpu_decoder(model: PreTrainedModel, folder: Path, kind: str = "w8a8",
                 q4k: Mapping[str, KQuantWeights] | None = None,
                 kernel_lib: object | None = None,
                 on_stored: Callable[[], None] = lambda: None) -> CpuDecoder:
    """The ``kind`` CPU forward of ``model`` (loaded from ``folder``): from the store when it
    holds a sound copy, else quantized now (``q4k``: the source file's Q4_K and Q6_K matrices, for
    "w4a8") and stored for the next start (then ``on_stored`` is called)."""
    out_dir = store_dir(folder, kind)
    decoder = _from_store(model, out_dir, kind, kernel_lib)
    if decoder is not None:
        return decoder
    weights = export_weights(model, kind, q4k)
    try:
        _save(weights, out_dir)
    except OSError as exc:  # a full or read-only disk costs the next start time, nothing else
        logger.warning("could not store %s weights in %s: %s", kind, out_dir, exc)
    else:
        on_stored()
    return CpuDecoder(model, kind, weights, kernel_lib)


def pack_from_gguf(spec: ModelSpec, model: PreTrainedModel, folder: Path, kind: str,
                   kernel_lib: object | None, progress: Progress) -> CpuDecoder:
    """The ``kind`` CPU forward of a GGUF model (``model`` a skeleton from its meta ``folder``),
    packed straight from the file (``gguf_pack``); a built-in's assembled file is deleted once
    the pack is stored (``release_assembled``)."""
    progress(f"{kind} weights of {spec.model} from its GGUF file (done once)", 0.5)
    source = kquant_source(spec, progress) or Path(spec.model)  # a built-in checked whole
    try:
        stored = fill_from_gguf(model, source, kind)
    except (ValueError, KeyError, *GGUF_READ_ERRORS) as exc:
        raise ModelLoadError(f"could not read the weights of {spec.model} from {source}: "
                             f"{exc}") from exc
    if stored.unserved:  # logged by the reader
        progress(unserved_message(source, stored.unserved), 0.5)
    builtin = BUILTIN_MODELS.get(spec.model)
    return cpu_decoder(model, folder, kind, stored, kernel_lib,
                       (lambda: release_assembled(builtin)) if builtin else lambda: None)


def gguf_source(spec: ModelSpec) -> Path | None:
    """The GGUF file a model is converted from (built-in or a user's .gguf), else None."""
    if spec.model in BUILTIN_MODELS:
        return builtin_gguf_path(BUILTIN_MODELS[spec.model])
    path = Path(spec.model).expanduser()
    return path if path.suffix == ".gguf" else None


def kquant_source(spec: ModelSpec, progress: Progress) -> Path | None:
    """The GGUF a pack is about to read whole: a built-in one checked whole first, by its CRC32
    (~0.3 s for the 1.5B's 1.1 GB), and assembled again if damaged; a user's file as it is
    (theirs: the pack is made from it, ``gguf_pack``, or its matrices are compared with a
    converted model's weights before they are used, ``weight_formats``)."""
    if spec.model in BUILTIN_MODELS:
        return assemble_builtin(BUILTIN_MODELS[spec.model], progress, full=True)
    return gguf_source(spec)


def cpu_format(spec: ModelSpec, progress: Progress) -> tuple[str, object | None]:
    """The CPU forward a spec of CPU_QUANTIZATIONS gets here, and the kernel library for the
    w4a8 kinds. They need the native kernels (a C compiler, and AVX-512 VNNI or AVX2 on x86:
    ``serving_kernels``), and "w4a8" a GGUF source (its Q4_K and Q6_K matrices); without them
    it is served as "w8a8", and the log and progress say why."""
    if spec.quantization == "w8a8":
        return "w8a8", None
    if spec.quantization == "w4a8" and gguf_source(spec) is None:
        reason = "it is not a GGUF model (no Q4_K or Q6_K matrices to keep)"
    else:
        try:
            return spec.quantization, serving_kernels(kernel_dir())
        except KernelUnavailable as exc:
            reason = f"the Q4_K / Q6_K kernels are unavailable here: {exc}"
    message = f"{spec.model}: {spec.quantization} served as w8a8 because {reason}"
    logger.warning(message)
    progress(message, 0.0)
    return "w8a8", None
