"""A built-in model's assembled GGUF is an intermediate: the packages are the source. Once a
pack holds what the CPU forward serves, the assembled copy is deleted (the cache holds the
packs, not the 1.1 GB file a second time), a warm start never assembles it again, and the
library and the drafter finder read its header from the packages' first bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_files import fake_builtin

from localspec.config import ModelSpec
from localspec.errors import ModelLoadError
from localspec.models import cache, drafter_finder, library, packed_store
from localspec.models.loading import load_model
from localspec.runtime import gguf_header
from localspec.runtime.gguf_header import read_gguf_header, read_gguf_header_parts

pytestmark = pytest.mark.usefixtures("own_cache")


def test_assembled_gguf_is_released_once_packed_and_never_assembled_again(
        tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = fake_builtin([tiny_gguf[:3000], tiny_gguf[3000:]], tmp_path, monkeypatch)
    spec = ModelSpec("fake-model", dtype="float32", quantization="w8a8")
    first = load_model(spec)
    assert (packed_store.store_dir(first.folder) / packed_store.WEIGHTS_NAME).is_file()
    gguf = cache.builtin_gguf_path(builtin)
    assert not gguf.exists() and not list(gguf.parent.glob("*.manifest.json"))

    def refuse(*_args: object, **_kwargs: object) -> Path:
        raise AssertionError("a warm start assembled the GGUF")

    monkeypatch.setattr(cache, "assemble_builtin", refuse)
    monkeypatch.setattr(packed_store, "assemble_builtin", refuse)
    monkeypatch.setattr("localspec.models.gguf_meta.assemble_builtin", refuse)
    again = load_model(spec)
    ids = [3, 7, 11, 5]
    assert first.runner().forward(ids).equal(again.runner().forward(ids))

    entry = next(e for e in library.builtin_entries() if e.name == "fake-model")
    assert entry.facts is not None and entry.facts.architecture == "qwen2", entry
    assert entry.size == len(tiny_gguf)
    words = drafter_finder.vocabulary(entry)
    assert len(words.tokens) > 100 and not gguf.exists()


def test_a_pack_that_cannot_be_stored_keeps_the_assembled_gguf(
        tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: the next start packs again, from the assembled file still there."""
    builtin = fake_builtin([tiny_gguf], tmp_path, monkeypatch)

    def full_disk(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_store, "_save", full_disk)
    load_model(ModelSpec("fake-model", dtype="float32", quantization="w8a8"))
    assert cache.builtin_gguf_path(builtin).read_bytes() == tiny_gguf


@pytest.mark.parametrize("cut", [7, 4096, 20000])
def test_header_from_parts_is_the_files(tiny_gguf: bytes, tmp_path: Path, cut: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts cut anywhere (inside the header too); a 1 KiB first read makes it read more."""
    monkeypatch.setattr(gguf_header, "HEADER_FIRST_READ", 1024)
    whole = tmp_path / "whole.gguf"
    whole.write_bytes(tiny_gguf)
    parts = [tmp_path / "a.bin", tmp_path / "b.bin"]
    parts[0].write_bytes(tiny_gguf[:cut])
    parts[1].write_bytes(tiny_gguf[cut:])
    arrays = frozenset({"tokenizer.ggml.tokens"})
    header = read_gguf_header_parts(parts, whole, len(tiny_gguf), arrays)
    assert header == read_gguf_header(whole, arrays)


def test_damaged_header_in_parts_is_a_clear_error(tiny_gguf: bytes, tmp_path: Path) -> None:
    part = tmp_path / "a.bin"
    part.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelLoadError, match=r"fake\.gguf"):
        read_gguf_header_parts([part], tmp_path / "fake.gguf", len(tiny_gguf))
    part.write_bytes(tiny_gguf[:2000])  # the header runs past the end of every part
    with pytest.raises(ModelLoadError, match=r"fake\.gguf"):
        read_gguf_header_parts([part], tmp_path / "fake.gguf", len(tiny_gguf))


def test_a_builtin_with_a_damaged_package_is_listed_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_builtin([b"GGUF" + b"\xff" * 60], tmp_path, monkeypatch)
    entry = next(e for e in library.builtin_entries() if e.name == "fake-model")
    assert entry.facts is None and "fake-model.gguf" in (entry.error or "")
    assert entry.size == 64
