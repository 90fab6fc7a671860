"""Same-size damage where the start-up fingerprint does not look: inside a packed-weights file
(a layer's tensor, the memory-mapped embedding, a tensor's header entry), inside a converted
folder's weights or tokenizer, inside a built-in GGUF about to be packed. Each must end in the
same answer as before the damage (the artefact rebuilt, a warning naming file and tensor),
never in garbage.

The tiny files are sampled like real ones (``_BLOCK_SIZE`` shrunk to 256 bytes), and the damage is
put between the sampled blocks: the fingerprint alone would not see it. One real test damages
1 MiB in the middle of SmolLM2's w8a8 pack (a copy in ``tmp_path``) and asks the CLI again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from model_files import fake_builtin
from safetensors.torch import load_file

import localspec.models.integrity as integrity
from localspec.config import ModelSpec, cache_root
from localspec.models import cache, packed_store
from localspec.models.loading import load_model

IDS = list(range(3, 40))


@pytest.fixture(autouse=True)
def isolated(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of the test's own; tiny files are fingerprinted by 256-byte blocks (real-model
    tests keep the real sampling), so that damage can fall between the sampled blocks."""
    monkeypatch.chdir(tmp_path)
    if request.node.get_closest_marker("real_model") is None:
        monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "localspec-cache"))
        monkeypatch.setattr(integrity, "_BLOCK_SIZE", 256)


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes lie in the safetensors file ``path`` (absolute offsets)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(size))[name]["data_offsets"]
    return 8 + size + begin, 8 + size + end


def tensor_at(path: Path, offset: int) -> str:
    """The tensor whose bytes hold ``offset``."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return next(name for name, entry in header.items()
                if 8 + size + entry["data_offsets"][0] <= offset
                < 8 + size + entry["data_offsets"][1])


def unsampled(path: Path, begin: int, end: int, length: int) -> int:
    """The first offset in [begin, end) where ``length`` bytes touch no fingerprint block."""
    blocks = integrity._block_offsets(path.stat().st_size)
    for start in range(begin, end - length + 1):
        if all(start + length <= o or start >= o + integrity._BLOCK_SIZE for o in blocks):
            return start
    raise AssertionError(f"no unsampled {length} bytes in [{begin}, {end}) of {path}")


def scramble(path: Path, start: int, length: int) -> None:
    """Same-size damage in place: every byte of the range changed."""
    with path.open("r+b") as f:
        f.seek(start)
        data = f.read(length)
        f.seek(start)
        f.write(bytes(b ^ 0xA5 for b in data))


def warned(caplog: pytest.LogCaptureFixture, *needles: str) -> bool:
    return any(all(n in r.getMessage() for n in needles) for r in caplog.records
               if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("kind", ["w8a8", "requant-q4k"])
@pytest.mark.parametrize("where", ["middle", "embed"])
def test_same_size_damage_in_a_pack_is_found_and_rebuilt(
        kind: str, where: str, saved_model_dir: Path, session_kernels: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Damage in the middle of the pack (a layer's int8 or Q4_K bytes) or inside the
    memory-mapped embedding: the load names the file and the tensor, packs again, and the
    logits are those of the undamaged pack, bit for bit."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization=kind)
    first = load_model(spec).runner().forward(IDS)
    pack = packed_store.store_dir(saved_model_dir, kind) / packed_store.WEIGHTS_NAME
    name = "embed" if where == "embed" else tensor_at(pack, pack.stat().st_size // 2)
    begin, end = tensor_span(pack, name)
    scramble(pack, unsampled(pack, begin, end, min(256, end - begin)), min(256, end - begin))
    assert integrity.verify_manifest(pack.parent / integrity.MANIFEST_NAME) is None  # unseen
    with caplog.at_level(logging.WARNING):
        again = load_model(spec)
    assert torch.equal(again.runner().forward(IDS), first)
    assert warned(caplog, f"{pack.parent}: {pack.name}: tensor {name!r} fails its CRC32")
    assert load_model(spec).runner().forward(IDS).equal(first)  # the new pack is sound


def test_damaged_header_entry_is_found(saved_model_dir: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """A tensor's dtype changed in the header ("I8" read as "U8": the same bytes, other
    numbers) is damage to that tensor too."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8")
    first = load_model(spec).runner().forward(IDS)
    pack = packed_store.store_dir(saved_model_dir) / packed_store.WEIGHTS_NAME
    data = pack.read_bytes()
    header = data[8:8 + int.from_bytes(data[:8], "little")]
    blocks = integrity._block_offsets(len(data))
    needle = b'"dtype":"I8"'
    at = header.find(needle)
    while at >= 0 and any(o < 8 + at + len(needle) and 8 + at < o + integrity._BLOCK_SIZE
                          for o in blocks):
        at = header.find(needle, at + 1)
    assert at >= 0, "every int8 entry lies in a sampled block"
    name = header[:at].rsplit(b'"', 2)[-2].decode()  # the key of the entry holding the dtype
    scramble_at = 8 + at + len(b'"dtype":"')
    with pack.open("r+b") as f:
        f.seek(scramble_at)
        f.write(b"U")
    assert integrity.verify_manifest(pack.parent / integrity.MANIFEST_NAME) is None
    with caplog.at_level(logging.WARNING):
        again = load_model(spec)
    assert torch.equal(again.runner().forward(IDS), first)
    assert warned(caplog, f"{pack.parent}: {pack.name}: tensor {name!r} fails its CRC32")


def test_damaged_converted_weights_are_rebuilt_before_transformers_reads_them(
        tiny_gguf: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A converted folder's weights are read whole by a load without a pack ("none" here, or
    the load that packs): damage between the sampled blocks is found then, the folder is
    converted again, and the model is the undamaged one."""
    (tmp_path / "mine.gguf").write_bytes(tiny_gguf)
    spec = ModelSpec(str(tmp_path / "mine.gguf"), dtype="bfloat16")
    loaded = load_model(spec)
    first = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    weights = loaded.folder / "model.safetensors"
    name = tensor_at(weights, weights.stat().st_size // 2)
    begin, end = tensor_span(weights, name)
    scramble(weights, unsampled(weights, begin, end, 64), 64)
    assert integrity.verify_manifest(loaded.folder / integrity.MANIFEST_NAME) is None
    with caplog.at_level(logging.WARNING):
        again = load_model(spec)
    state = again.model.state_dict()
    assert state.keys() == first.keys() and all(torch.equal(state[k], first[k]) for k in first)
    assert warned(caplog, str(loaded.folder), "model.safetensors")


def test_damaged_tokenizer_of_a_converted_folder_is_rebuilt(
        tiny_gguf: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The quick start from a pack reads the converted folder's tokenizer and config, never
    its weights: those files are checked whole at every load (a few MB at most). A vocabulary
    entry renamed in place (valid JSON, same size) would tokenize otherwise."""
    (tmp_path / "mine.gguf").write_bytes(tiny_gguf)
    spec = ModelSpec(str(tmp_path / "mine.gguf"), dtype="bfloat16", quantization="w8a8")
    loaded = load_model(spec)
    text = "def add(a, b): return a + b"
    ids = loaded.tokenizer.encode(text)
    tokenizer_file = loaded.folder / "tokenizer.json"
    data = tokenizer_file.read_bytes()
    blocks = integrity._block_offsets(len(data))
    for char in sorted(set(text) - {" "}):  # a letter's id changed: '"a": 65' -> '"a": 66'
        entry = re.search(rb'\n\s*"' + re.escape(char.encode()) + rb'": (\d+),', data)
        at = entry.end(1) - 1
        if all(at < o or at >= o + integrity._BLOCK_SIZE for o in blocks):
            break
    else:
        raise AssertionError("every letter's entry lies in a sampled block")
    tokenizer_file.write_bytes(data[:at] + str((data[at] - 47) % 10).encode() + data[at + 1:])
    assert integrity.verify_manifest(loaded.folder / integrity.MANIFEST_NAME) is None
    with caplog.at_level(logging.WARNING):
        again = load_model(spec)
    assert again.tokenizer.encode(text) == ids
    assert warned(caplog, str(loaded.folder), "tokenizer.json")


def test_builtin_gguf_is_checked_whole_before_it_is_packed(
        tiny_gguf: bytes, tmp_path: Path, session_kernels: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A w4a8 pack reads the built-in GGUF's Q4_K and Q6_K matrices: damage to the GGUF
    between its sampled blocks is found before that read and the file assembled again."""
    builtin = fake_builtin([tiny_gguf[:5000], tiny_gguf[5000:]], tmp_path, monkeypatch)
    spec = ModelSpec("fake-model", dtype="bfloat16", quantization="w4a8")
    folder = load_model(spec).folder
    pack = packed_store.store_dir(folder, "w4a8")
    packed = load_file(pack / packed_store.WEIGHTS_NAME)
    shutil.rmtree(pack)  # the next load packs again
    gguf = cache.assemble_builtin(builtin)  # released once packed: assembled to be damaged
    size = gguf.stat().st_size
    scramble(gguf, unsampled(gguf, size // 2, size, 64), 64)
    assert integrity.verify_manifest(gguf.with_name(gguf.name + ".manifest.json")) is None
    with caplog.at_level(logging.WARNING):
        load_model(spec)
    again = load_file(pack / packed_store.WEIGHTS_NAME)
    assert sorted(again) == sorted(packed) and all(again[k].equal(packed[k]) for k in packed)
    assert warned(caplog, str(gguf), "failed its integrity check")


@pytest.mark.real_model
def test_real_pack_damaged_in_the_middle_answers_correctly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case: 1 MiB of random bytes in the middle of SmolLM2's w8a8 pack gave
    " the the the the the or to the we to be the" with exit 0. A copy of the cache (hardlinks,
    but a file of its own for the damaged pack) must answer as before the damage."""
    spec = ModelSpec("smollm2-135m-instruct", dtype="bfloat16", quantization="w8a8")
    real_folder = load_model(spec).folder  # assembled and packed in the real cache
    real_pack = packed_store.store_dir(real_folder)
    copy = tmp_path / "cache"
    monkeypatch.setenv("LOCALSPEC_CACHE", str(copy))
    folder = cache_root() / real_folder.relative_to(real_folder.parents[1])
    shutil.copytree(real_folder, folder, copy_function=os.link)
    pack_dir = packed_store.store_dir(folder)
    shutil.copytree(real_pack, pack_dir, copy_function=os.link)
    pack = pack_dir / packed_store.WEIGHTS_NAME
    pack.unlink()
    shutil.copyfile(real_pack / packed_store.WEIGHTS_NAME, pack)  # ours to damage
    args = ("generate", "--preset", "cpu-smollm2-ngram", "--max-new-tokens", "24",
            "--prompt", "What is the capital of France? Answer in one sentence.")
    code, clean, _ = run_cli(capsys, *args)
    assert code == 0 and "Paris" in clean
    size = pack.stat().st_size
    with pack.open("r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(1 << 20))
    assert integrity.verify_manifest(pack_dir / integrity.MANIFEST_NAME) is None  # unseen
    with caplog.at_level(logging.WARNING):
        code, answer, err = run_cli(capsys, *args)
    assert code == 0 and answer == clean, err
    assert warned(caplog, f"{pack_dir}: {pack.name}: tensor '", "fails its CRC32")


def test_a_start_reads_and_checks_each_stored_tensor_once(saved_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of the pack is read, and only once (a second read would cost its CRC32
    again, on top of the read)."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8")
    load_model(spec)
    pack = packed_store.store_dir(saved_model_dir) / packed_store.WEIGHTS_NAME
    reads: list[str] = []
    real_read = packed_store._FileTensors.__getitem__
    monkeypatch.setattr(packed_store._FileTensors, "__getitem__",
                        lambda self, name: reads.append(name) or real_read(self, name))
    assert load_model(spec).decoder is not None
    with pack.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert sorted(name for name in reads if name in header) == sorted(set(header)
                                                                       - {"__metadata__"})
