"""What the cache holds per model (``models.cache_use``), as ``localspec models list`` shows it,
and ``localspec models free NAME``: it deletes the model's packs and conversions (and a
built-in's assembled GGUF), never the user's own file, and the next start makes them again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli
from library_files import write_gguf
from model_files import fake_builtin

from localspec.config import ModelSpec, cache_root
from localspec.models import cache_use
from localspec.models.cache import assemble_builtin
from localspec.models.loading import load_model

pytestmark = pytest.mark.usefixtures("own_folders")


def run_models(*args: str) -> tuple[int, str, str]:
    return run_cli(None, "models", *args)


def listed(name: str) -> dict[str, int]:
    code, out, err = run_models("list", "--json")
    assert code == 0, err
    return next(e for e in json.loads(out)["models"] if e["name"] == name)["cache_bytes"]


def test_a_users_gguf_shows_its_cache_and_free_deletes_only_that(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "mine.gguf", arch="llama", hidden=256,
                      types={"attn_q": "Q4_K", "attn_k": "Q4_K"})
    assert run_models("add", str(gguf))[0] == 0
    assert listed("mine.gguf")["total"] == 0
    served = load_model(ModelSpec(str(gguf), dtype="bfloat16", quantization="w8a8"))
    load_model(ModelSpec(str(gguf), dtype="float32", quantization="none"))  # a conversion
    sizes = listed("mine.gguf")
    assert sizes["packs"] > 0 and sizes["conversions"] > 0 and sizes["gguf"] == 0
    code, out, _ = run_models("list")
    assert code == 0 and "packs" in out and "converted" in out
    before = gguf.read_bytes()
    code, out, err = run_models("free", "mine.gguf")
    assert code == 0 and "freed" in out, err
    assert gguf.read_bytes() == before  # the user's own file stays
    assert listed("mine.gguf")["total"] == 0
    assert not [p for p in cache_root().rglob("*") if p.is_file()
                and p.parent.name != "kernels" and "kernels" not in p.parts]
    again = load_model(ModelSpec(str(gguf), dtype="bfloat16", quantization="w8a8"))
    ids = [3, 7, 11, 5]
    assert (again.runner().forward(ids) == served.runner().forward(ids)).all()


def test_free_of_a_builtin_deletes_its_assembled_gguf_and_packs(
        tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = fake_builtin([tiny_gguf[:5000], tiny_gguf[5000:]], tmp_path, monkeypatch)
    load_model(ModelSpec("fake-model", dtype="bfloat16", quantization="w8a8"))
    assert not cache_use.cache_use("fake-model").gguf  # released once packed
    assemble_builtin(builtin)  # as a path that reads the file does (a float conversion)
    use = cache_use.cache_use("fake-model")
    assert use.gguf and use.packs and use.conversions  # conversions: its config and tokenizer
    assert not (cache_root() / "models").exists()  # no float conversion for the CPU forward
    code, out, err = run_models("free", "fake-model")
    assert code == 0 and "its assembled GGUF" in out, err
    assert not any(p.exists() for p in use.paths)
    assert cache_use.cache_use("fake-model").sizes()["total"] == 0
    assert load_model(ModelSpec("fake-model", dtype="bfloat16", quantization="w8a8")).decoder


def test_free_of_an_unknown_model_is_a_clear_error() -> None:
    assert_user_error(run_models("free", "no-such-model"), "no model 'no-such-model'")
