"""The model library: what it finds (models folder, added paths, the Hugging Face cache), what
it reads from each model's files, what it refuses to add, and what removing does and does not
delete. Tiny models only: GGUF files written here, a save_pretrained folder, a Hugging Face
cache filled by huggingface_hub itself from a local stand-in for the Hub."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import pytest
from conftest import assert_user_error, run_cli
from hub_server import FakeHub, Repo, serve
from library_files import write_gguf

from localspec.config import NATIVE_ARCHITECTURES, NATIVE_GGUF_TYPES
from localspec.errors import ModelLoadError
from localspec.models.describe import describe, native_reason
from localspec.models.library import library_path, list_library
from localspec.runtime.decoder import CPU_MODEL_TYPES
from localspec.runtime.gguf_header import read_gguf_header
from localspec.runtime.gguf_kquants import read_kquant_matrices


@pytest.fixture(autouse=True)
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty library: its own data and models folders, an empty Hugging Face cache, and no
    built-in models (which are listed from the real cache otherwise)."""
    from huggingface_hub import constants

    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr("localspec.models.library.builtin_entries", list)
    (tmp_path / "models").mkdir()
    return tmp_path / "models"


def _names(*args: str) -> dict[str, dict]:
    return {e["name"]: e for e in json.loads(run_models(*args)[1])["models"]}


def run_models(*args: str) -> tuple[int, str, str]:
    return run_cli(None, "models", *args)


# ----------------------------------------------------------------------------- reading files


def test_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    """The fast reader gives the fields, tensor table and data offsets the gguf package's own
    (slow) reader gives."""
    path = write_gguf(tmp_path / "m.gguf", hidden=256, types={"*": "Q4_K", "ffn_down": "Q6_K"},
                      padding=3)
    header = read_gguf_header(path, frozenset({"tokenizer.ggml.tokens"}))
    reference = gguf.GGUFReader(str(path))
    assert [(t.name, t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
            for t in reference.tensors] == [(t.name, t.type_name, header.data_start + t.offset,
                                             t.nbytes) for t in header.tensors]
    assert header.fields["tokenizer.ggml.tokens"] == \
        reference.fields["tokenizer.ggml.tokens"].contents()
    for key in ("general.architecture", "qwen2.context_length", "qwen2.block_count"):
        assert header.fields[key] == reference.fields[key].contents()


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_a_truncated_gguf_is_refused(tmp_path: Path, keep: float) -> None:
    """Cut in its header or in its tensors, a file is named as truncated or damaged."""
    data = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"truncated|not a complete GGUF|damaged"):
        read_gguf_header(cut)


def test_native_path_is_decided_from_the_names_the_loader_uses(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 layer matrices of a llama/qwen2 file are native; any
    other type or architecture is not, and says why; and the loader's own lists are those
    names."""
    assert CPU_MODEL_TYPES == NATIVE_ARCHITECTURES
    native = write_gguf(tmp_path / "n.gguf", hidden=256, types={"*": "Q4_K", "ffn_down": "Q6_K"})
    assert describe(native).native and describe(native).quantization == "Q4_K_M (Q4_K, Q6_K)"
    legacy = write_gguf(tmp_path / "l.gguf", hidden=256,
                        types={"*": "Q8_0", "attn_v": "Q4_0", "ffn_down": "Q5_K"})
    assert describe(legacy).native and len(read_kquant_matrices(legacy)) == 7
    mixed = write_gguf(tmp_path / "m.gguf", hidden=256, types={"*": "Q4_K", "attn_v": "Q4_1"})
    assert "Q4_1" in describe(mixed).native_reason
    # what w4a8 takes as stored is exactly the NATIVE_GGUF_TYPES matrices; the others are
    # named in one logged line
    with caplog.at_level(logging.WARNING):
        matrices = read_kquant_matrices(mixed)
    taken = set(matrices)
    assert taken == {m for m in taken if "v_proj" not in m} and len(taken) == 6
    assert matrices.unserved == ("Q4_1",)
    assert "Q4_1 matrices have no native kernel" in caplog.text
    assert set(NATIVE_GGUF_TYPES) == {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"}
    phi = write_gguf(tmp_path / "p.gguf", arch="phi3", hidden=256, types={"*": "Q4_K"})
    assert "architecture 'phi3'" in describe(phi).native_reason
    assert "not a GGUF" in native_reason("llama", None)


# ----------------------------------------------------------------------------- listing


def test_list_finds_the_models_folder_added_paths_and_the_hf_cache(
        library: Path, tmp_path: Path, saved_model_dir: Path) -> None:
    (library / "org" / "tiny-GGUF").mkdir(parents=True)
    write_gguf(library / "org" / "tiny-GGUF" / "tiny-Q4_K_M.gguf", hidden=256,
               types={"*": "Q4_K"})
    shutil.copytree(saved_model_dir, library / "org" / "tiny")
    (library / ".downloads" / "org--x").mkdir(parents=True)  # a download under way: not listed
    write_gguf(library / ".downloads" / "org--x" / "half.gguf")
    mine = write_gguf(tmp_path / "mine.gguf")
    assert run_models("add", str(mine))[0] == 0
    repo = {name: p.read_bytes() for name, p in
            ((p.name, p) for p in saved_model_dir.iterdir() if p.is_file())}
    with serve(FakeHub({"org/cached": Repo(repo)})) as hub:
        from huggingface_hub import constants, snapshot_download

        snapshot_download("org/cached", cache_dir=constants.HF_HUB_CACHE, endpoint=hub.url)
    entries = _names("list", "--json")
    assert set(entries) == {"org/tiny-GGUF/tiny-Q4_K_M.gguf", "org/tiny", "mine.gguf",
                            "hf:org/cached"}
    gguf_entry, folder, added = (entries[n] for n in ("org/tiny-GGUF/tiny-Q4_K_M.gguf",
                                                       "org/tiny", "mine.gguf"))
    assert gguf_entry["native"] and gguf_entry["architecture"] == "qwen2"
    assert gguf_entry["context_length"] == 64 and gguf_entry["source"] == "models folder"
    assert folder["quantization"] == "F32" and folder["native"] is False
    assert folder["size_bytes"] == sum(p.stat().st_size for p in saved_model_dir.iterdir())
    assert added["source"] == "added" and added["model"] == str(mine)
    assert entries["hf:org/cached"]["model"] == "org/cached"  # what a preset says for it
    code, table, _ = run_models()  # no action: the table
    assert code == 0 and "org/tiny-GGUF/tiny-Q4_K_M.gguf" in table and "native" in table


def test_an_unreadable_entry_is_listed_with_why(library: Path) -> None:
    path = write_gguf(library / "broken.gguf")
    path.write_bytes(path.read_bytes()[:5000])
    entry = _names("list", "--json")["broken.gguf"]
    assert "truncated" in entry["error"] or "not a complete" in entry["error"]


def test_a_damaged_library_file_is_one_line(library: Path) -> None:
    library_path().parent.mkdir(parents=True, exist_ok=True)
    library_path().write_text('{"paths": 3}', encoding="utf-8")
    assert_user_error(run_models("list"), "library", "damaged")


# ----------------------------------------------------------------------------- adding


def test_add_records_a_path_once(tmp_path: Path, saved_model_dir: Path) -> None:
    mine = write_gguf(tmp_path / "mine.gguf")
    code, out, _ = run_models("add", str(mine))
    assert code == 0 and "mine.gguf" in out
    assert_user_error(run_models("add", str(mine)), "already in the library as 'mine.gguf'")
    assert run_models("add", str(saved_model_dir))[0] == 0
    assert json.loads(library_path().read_text())["paths"] == [str(mine), str(saved_model_dir)]


def _vit_folder(folder: Path, saved_model_dir: Path) -> Path:
    shutil.copytree(saved_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "vit"}))
    return folder


@pytest.mark.parametrize("case", ["not-a-model", "truncated", "gguf-arch", "folder-arch",
                                  "no-weights", "missing", "not-gguf"])
def test_bad_models_are_refused_and_nothing_is_recorded(
        case: str, tmp_path: Path, saved_model_dir: Path) -> None:
    """Each is one line and exit 2; the library's file is not even created."""
    if case == "not-a-model":
        (tmp_path / "photos").mkdir()
        given, needle = tmp_path / "photos", "not a model: it has no config.json"
    elif case == "truncated":
        given = write_gguf(tmp_path / "t.gguf")
        given.write_bytes(given.read_bytes()[:-100])
        needle = "truncated GGUF"
    elif case == "gguf-arch":
        given, needle = write_gguf(tmp_path / "b.gguf", arch="bert"), "architecture 'bert'"
    elif case == "folder-arch":
        given, needle = _vit_folder(tmp_path / "vit", saved_model_dir), "'vit' is not supported"
    elif case == "no-weights":
        shutil.copytree(saved_model_dir, tmp_path / "w")
        (tmp_path / "w" / "model.safetensors").unlink()
        given, needle = tmp_path / "w", "no weights"
    elif case == "missing":
        given, needle = tmp_path / "nowhere" / "x.gguf", "no such file or folder"
    else:
        given = tmp_path / "notes.txt"
        given.write_text("hello")
        needle = "give a .gguf file or a model folder"
    assert_user_error(run_models("add", str(given)), needle)
    assert not library_path().exists()


# ----------------------------------------------------------------------------- removing


def test_remove_forgets_an_added_path_and_keeps_its_file(tmp_path: Path) -> None:
    mine = write_gguf(tmp_path / "mine.gguf")
    run_models("add", str(mine))
    code, out, _ = run_models("remove", "mine.gguf")
    assert code == 0 and "forgot" in out and mine.is_file()
    assert "mine.gguf" not in _names("list", "--json")


def test_remove_deletes_from_the_models_folder_only_with_yes(library: Path) -> None:
    folder = library / "org" / "tiny-GGUF"
    folder.mkdir(parents=True)
    path = write_gguf(folder / "a.gguf")
    size = path.stat().st_size
    assert_user_error(run_models("remove", "org/tiny-GGUF/a.gguf"), "--yes", str(path))
    assert path.is_file()
    code, out, _ = run_models("remove", "org/tiny-GGUF/a.gguf", "--yes")
    assert code == 0 and f"freed {size / 2**30:.2f} GiB" in out
    assert not path.exists() and not (library / "org").exists()  # empty folders pruned


def test_remove_deletes_a_hf_cache_repo_only_with_yes(saved_model_dir: Path) -> None:
    from huggingface_hub import constants, snapshot_download

    repo = {p.name: p.read_bytes() for p in saved_model_dir.iterdir() if p.is_file()}
    with serve(FakeHub({"org/cached": Repo(repo)})) as hub:
        folder = Path(snapshot_download("org/cached", cache_dir=constants.HF_HUB_CACHE,
                                        endpoint=hub.url))
    assert_user_error(run_models("remove", "hf:org/cached"), "Hugging Face cache", "--yes")
    assert folder.is_dir()
    code, out, _ = run_models("remove", "hf:org/cached", "--yes")
    assert code == 0 and "freed" in out and not folder.exists()


def test_a_builtin_model_is_never_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.models import library as lib
    from localspec.models.builtin import BUILTIN_MODELS

    monkeypatch.setattr(lib, "builtin_entries", lambda: [lib.LibraryEntry(
        "smollm2-135m-instruct", "built-in", "smollm2-135m-instruct", None)])
    assert_user_error(run_models("remove", "smollm2-135m-instruct", "--yes"), "built-in",
                      BUILTIN_MODELS["smollm2-135m-instruct"].packages[0])
    assert_user_error(run_models("remove", "no-such-model"), "no model 'no-such-model'")
    assert [e.name for e in list_library()] == ["smollm2-135m-instruct"]


# ----------------------------------------------------------------------------- other mistakes


def test_mistakes_around_the_library_are_one_line(tmp_path: Path, library: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    mine = write_gguf(tmp_path / "mine.gguf")
    assert_user_error(run_models("add", str(mine), "--include", "*.gguf"),
                      "--include and --revision are for a Hub repo")
    assert_user_error(run_models("add", "not/a/repo/id"), "not a Hugging Face repo id")
    assert_user_error(run_models("drafters", "nothing-called-so"), "no model 'nothing-called-so'")
    assert_user_error(run_models("drafters", "x", "--drafter", "ngram"), "give both")
    head = library / "some-head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"],
                                                  "base_model_name_or_path": "x"}))
    assert_user_error(run_models("drafters", "some-head"), "a draft head, not a model")
    data = tmp_path / "data-file"
    data.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("LOCALSPEC_DATA", str(data))
    assert_user_error(run_models("add", str(mine)), "cannot write the model library's list",
                      "LOCALSPEC_DATA")
