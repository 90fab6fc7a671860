"""Export and import of saved conversations (``localspec.chats.export``) and ``localspec chats``:
a JSON export read back and exported again is the same, an import can be repeated, a bad file
is refused whole with the field named; list, show, export and import from the command line,
and every mistake a user can make ends with one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli

from localspec.chats.export import parse_export, read_export, to_json, to_markdown
from localspec.chats.store import MAX_CHAT_TITLE_CHARS, ChatStore, Conversation, Message
from localspec.config import DATA_ENV
from localspec.errors import InputFileError

STATS = {"method": "ngram", "tokens_per_second": 41.27, "acceptance_rate": 0.625,
         "tokens_per_pass": 2.5, "new_tokens": 40}
SETTINGS = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "system": "Be brief."}


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder of the test's own, with two conversations in it."""
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    with ChatStore() as store:
        store.create([Message("user", "Palindromes in Python?"),
                      Message("assistant", "```python\ndef is_pal(s):\n    return s == s[::-1]\n"
                              "```", finish_reason="stop", preset="cpu-smollm2-ngram",
                              settings=SETTINGS, stats=STATS)])
        store.create([Message("system", "You are a pirate."), Message("user", "Ünïcödé 🚀"),
                      Message("assistant", "Arr, cut sho", complete=False,
                              preset="cpu-smollm2-ngram")])
    return tmp_path / "data"


def conversations() -> list[Conversation]:
    with ChatStore() as store:
        return [store.get(row.id) for row in reversed(store.list())]


def without_time(export: dict) -> dict:
    return {key: value for key, value in export.items() if key != "exported"}


def test_json_round_trip_and_a_repeated_import(data: Path, tmp_path: Path) -> None:
    first = to_json(conversations(), 0)
    parsed = parse_export(json.loads(json.dumps(first)), "export.json")
    with ChatStore(tmp_path / "other.db") as other:
        assert other.add(parsed) == (2, 0)
        again = to_json([other.get(row.id) for row in reversed(other.list())], 1)
        assert other.add(parsed) == (0, 2)  # already there: skipped, not doubled
        assert len(other.list()) == 2
    assert without_time(again) == without_time(first)
    answer = first["conversations"][0]["messages"][1]
    assert answer["stats"] == STATS and answer["settings"] == SETTINGS
    assert answer["preset"] == "cpu-smollm2-ngram" and answer["complete"] is True
    assert first["conversations"][1]["messages"][2]["complete"] is False


def test_markdown(data: Path) -> None:
    text = to_markdown(conversations())
    assert text.startswith("# Palindromes in Python?\n")
    assert "## You · " in text and "## LocalSpec · " in text and "## System · " in text
    assert ("*preset `cpu-smollm2-ngram` · method ngram · 41.3 tok/s · acceptance 62% · "
            "2.50 tokens per target pass*") in text
    assert "    return s == s[::-1]\n```" in text  # the answer as said, indentation kept
    assert "cut: the answer was interrupted before it ended*\n\nArr, cut sho" in text
    assert "```\nYou are a pirate.\n```" in text and "\n---\n" in text


def export_with(**changes: object) -> dict:
    message = {"role": "user", "content": "hi"}
    conversation = {"title": "t", "messages": [message]}
    for key, value in changes.items():
        target = message if key in ("role", "content", "stats", "created") else conversation
        target[key] = value
    return {"format": "localspec-chats", "version": 1, "conversations": [conversation]}


@pytest.mark.parametrize(("value", "needle"), [
    ([], "not a LocalSpec conversations export"),
    ({"format": "other"}, "not a LocalSpec conversations export"),
    ({"format": "localspec-chats", "version": 7, "conversations": []}, "newer LocalSpec"),
    ({"format": "localspec-chats", "version": 0, "conversations": []}, "version"),
    (export_with(role="robot"), r"conversations[0].messages[0].role: Input should be"),
    (export_with(content=5), r"conversations[0].messages[0].content"),
    (export_with(title="x" * (MAX_CHAT_TITLE_CHARS + 1)), "conversations[0].title: a title"),
    (export_with(stats={"rate": float("nan")}), "NaN"),
    (export_with(created="yesterday"), "not an ISO 8601 time"),
    (export_with(created="2024-01-01T00:00:00"), "UTC offset"),
    (export_with(id="../../etc"), "conversations[0].id"),
    (export_with(extra=1), "conversations[0].extra: Extra inputs"),
])
def test_bad_exports_are_refused_by_name(value: object, needle: str) -> None:
    with pytest.raises(InputFileError) as caught:
        parse_export(value, "chats.json")
    assert str(caught.value).startswith("chats.json: ") and needle in str(caught.value)


def test_an_import_is_all_or_nothing(data: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    good = export_with()["conversations"][0]
    bad = export_with(role="robot")["conversations"][0]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"format": "localspec-chats", "version": 1,
                                "conversations": [good, bad]}), encoding="utf-8")
    assert_user_error(run_cli(capsys, "chats", "import", str(path)),
                      "conversations[1].messages[0].role")
    assert len(conversations()) == 2  # the good one was not added either


@pytest.mark.parametrize(("content", "needle"), [
    (None, "cannot read the conversations export"),
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b"{not json", "not JSON"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"format": "localspec-chats", "x": "\\ud800"}', "lone surrogate"),
])
def test_unreadable_import_files(content: bytes | None, needle: str, data: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in.json"
    if content is not None:
        path.write_bytes(content)
    assert_user_error(run_cli(capsys, "chats", "import", str(path)), needle)
    with pytest.raises(InputFileError):
        read_export(tmp_path)  # a folder


def test_list_and_search(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "chats", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "UPDATED", "(UTC)", "MESSAGES", "TITLE"]
    assert lines[1].split()[0] == "2" and lines[1].endswith("Ünïcödé 🚀")  # newest first
    assert lines[2].split()[3] == "2" and lines[2].endswith("Palindromes in Python?")
    code, out, _ = run_cli(capsys, "chats", "list", "--search", "ÜNÏ", "--json")
    listed = json.loads(out)["conversations"]
    assert code == 0 and [c["id"] for c in listed] == [2] and listed[0]["messages"] == 3
    code, out, _ = run_cli(capsys, "chats", "list", "--search", "absent")
    assert code == 0 and "No saved conversations holding 'absent'" in out


def test_show(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "chats", "show", "1")
    assert code == 0 and out.startswith("# Palindromes in Python?") and "41.3 tok/s" in out
    code, out, _ = run_cli(capsys, "chats", "show", "2", "--json")
    (shown,) = json.loads(out)["conversations"]
    assert code == 0 and shown["messages"][2]["content"] == "Arr, cut sho"
    assert_user_error(run_cli(capsys, "chats", "show", "9"), "no conversation 9",
                      "`localspec chats list`")
    for bad in ("x", "0", "-3"):
        code, _, err = run_cli(capsys, "chats", "show", bad)
        assert code == 2 and "Traceback" not in err


def test_export_and_import_through_files(data: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "all.json"
    code, _, err = run_cli(capsys, "chats", "export", "--format", "json", "--out", str(out))
    assert code == 0 and "Wrote 2 conversations" in err
    everything = json.loads(out.read_text(encoding="utf-8"))
    assert [c["title"] for c in everything["conversations"]] == \
        ["Palindromes in Python?", "Ünïcödé 🚀"]  # oldest first, as they happened
    code, text, _ = run_cli(capsys, "chats", "export", "2")
    assert code == 0 and text.startswith("# Ünïcödé 🚀") and "Palindromes" not in text
    code, text, _ = run_cli(capsys, "chats", "export", "1", "--format", "json")
    assert code == 0 and len(json.loads(text)["conversations"]) == 1
    code, out_text, _ = run_cli(capsys, "chats", "import", str(out))
    assert code == 0 and "Imported 0 conversations" in out_text and "2 already saved" in out_text

    other = tmp_path / "elsewhere"
    code, out_text, _ = run_cli_in(capsys, other, "chats", "import", str(out))
    assert code == 0 and "Imported 2 conversations" in out_text
    code, text, _ = run_cli_in(capsys, other, "chats", "export", "--format", "json")
    assert without_time(json.loads(text)) == without_time(everything)

    assert_user_error(run_cli(capsys, "chats", "export", "--out",
                              str(tmp_path / "missing" / "x.md")), "cannot write the export")
    assert_user_error(run_cli(capsys, "chats", "export", "--out", str(tmp_path)),
                      "cannot write the export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.json", "data", "elsewhere"]
    code, _, err = run_cli(capsys, "chats", "export", "--format", "pdf")
    assert code == 2 and "invalid choice" in err


def run_cli_in(capsys: pytest.CaptureFixture[str], folder: Path,
               *args: str) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DATA_ENV, str(folder))
        return run_cli(capsys, *args)


def test_a_data_folder_that_cannot_be_written(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    assert_user_error(run_cli_in(capsys, blocker / "sub", "chats", "list"),
                      "cannot create the folder", DATA_ENV)


def test_a_damaged_database_is_set_aside_by_the_command_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "chats.db").write_bytes(b"\x00garbage" * 1000)
    code, out, _ = run_cli_in(capsys, folder, "chats", "list")
    assert code == 0 and "No saved conversations" in out
    assert "moved it to" in caplog.text and len(list(folder.glob("chats.db.damaged-*"))) == 1
