"""Bad input on the command line: each ends in one ``localspec: error: ...`` line and exit 2,
never a traceback, a hang or an internal error, and before any model loads where the input
alone can tell. Prompt files (every way a line can be wrong, lines JSON cannot hold, text that
is not Unicode, files that are not files), prompts whose bytes are not UTF-8, presets (missing,
unknown, a folder, broken or bottomless TOML), and the crash log of a real bug, whatever its
message holds."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli, write_preset
from transformers import AutoTokenizer

from localspec.drafters.head_files import read_config
from localspec.errors import InputFileError, ModelLoadError
from localspec.pipeline import Pipeline
from localspec.presets import list_preset_names, load_preset
from localspec.training.prompts import encode_prompts, load_prompts

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("own_cache")  # crash logs go there too


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "LOCALSPEC_CACHE": str(tmp_path / "cache")}


# ----------------------------------------------------------------------------- prompt files


BAD_LINES = [
    ('{"messages": "oops"}', "'messages' must be a non-empty list"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "with the keys 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "'content' must be a string"),
    ('{"messages": ["hi"]}', "messages[0] must be an object"),
    ('{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}',
     "key(s) tool_calls not allowed in a 'user' message"),
    ('{"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}',
     "'tool_calls' must be a non-empty list"),
    ('{"messages": [{"role": "assistant", "content": null}]}', "'content' must be a string"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": '
     '{"name": "f"}}]}]}', "messages[0] tool_calls[0] must be"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": '
     '{"name": "f", "arguments": "{oops"}}]}]}', "tool_calls[0] arguments: not JSON"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": '
     '{"name": "f", "arguments": "[1]"}}]}]}', "arguments must be a JSON object, got list"),
    ('{"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}',
     "'tool_call_id' must be a string"),
    ('{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}',
     "'tools' needs 'messages'"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {}}',
     "'tools' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}',
     "tools[0] must be"),
    ('{"prompt": 5}', "'prompt' must be a non-empty string"),
    ('{"prompt": "  "}', "'prompt' must be a non-empty string"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of"),
    ('{"category": 3, "prompt": "x"}', "'category' must be a string"),
    ('{"promt": "x"}', "unknown key(s) promt"),
    ("[1, 2]", "need a JSON object"),
    ("not json", "not JSON"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep-nesting"),
    pytest.param('{"prompt": "x", "category": ' + "7" * 5000 + "}",
                 f"more than {sys.get_int_max_str_digits()} digits", id="5000-digits"),
    pytest.param('{"prompt": "hi \\ud800 there"}', "U+D800 is a lone surrogate",
                 id="surrogate-prompt"),
    pytest.param('{"messages": [{"role": "user", "content": "\\udcff"}]}',
                 "the byte 0xff is not UTF-8", id="surrogate-content"),
    pytest.param('{"prompt": "x", "category": "a\\udfffb"}', "(character 2)",
                 id="surrogate-category"),
]


@pytest.mark.parametrize(("line", "needle"), BAD_LINES)
@pytest.mark.parametrize("command", ["bench", "verify"])
@pytest.mark.usefixtures("no_loading")
def test_bad_prompt_lines_name_file_and_line(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], tmp_path: Path,
        command: str, line: str, needle: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n", encoding="utf-8")
    assert_user_error(run_cli(capsys, command, "--preset", presets["ngram"], "--prompts",
                              str(path)), f"{path} line 3", needle)


@pytest.mark.usefixtures("no_loading")
def test_unreadable_prompt_files(capsys: pytest.CaptureFixture[str], presets: dict[str, str],
                                 tmp_path: Path) -> None:
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes('{"prompt": "ok"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # no writer: opening it would wait forever
    for path, needle in ((tmp_path, "cannot read the prompts file: it is a folder"),
                         (tmp_path / "missing.jsonl", "cannot read the prompts file"),
                         (Path("/dev/zero"), "it is not a regular file"),
                         (fifo, "it is not a regular file"),
                         (not_utf8, "line 2: not UTF-8"),
                         (empty, "no prompts")):
        assert_user_error(run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                                  str(path)), str(path), needle)
    with pytest.raises(InputFileError, match="line 2: not UTF-8"):
        load_prompts(str(not_utf8))


def test_prompt_file_with_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "hi", "category": "c"}\n')
    assert [(r["prompt"], r["category"]) for r in load_prompts(str(path))] == [("hi", "c")]


def test_builtin_prompts_are_valid() -> None:
    rows = load_prompts(None)
    assert rows and all(isinstance(r["category"], str) and r["where"] for r in rows)


@pytest.mark.parametrize("command", ["bench", "verify"])
def test_prompt_file_errors_found_after_encoding(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], tmp_path: Path,
        command: str) -> None:
    """A conversation the chat template refuses, or a prompt longer than the context: exit 2
    naming the line, before any method runs."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n"
                    + json.dumps({"prompt": "hello world " * 200}) + "\n", encoding="utf-8")
    assert_user_error(run_cli(capsys, command, "--preset", presets["ngram"], "--prompts",
                              str(path)), "line 2", "context holds 256")
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n",
                    encoding="utf-8")
    assert_user_error(run_cli(capsys, command, "--preset", presets["ngram"], "--prompts",
                              str(path)), "line 1", "unknown role robot")


AGENT_TEMPLATE = (  # renders the tools, and each call's arguments as JSON (as Qwen's does)
    "{% for t in tools or [] %}<|tools|>{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
AGENT_ROW = {
    "category": "agent",
    "tools": [{"type": "function", "function": {
        "name": "read_file", "parameters": {"type": "object",
                                            "properties": {"path": {"type": "string"}}}}}],
    "messages": [
        {"role": "user", "content": "fix add.py"},
        {"role": "assistant", "content": None, "tool_calls": [  # as OpenAI's API sends it
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "add.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def add(a, b):\n    return a - b\n"}],
}


@pytest.fixture(scope="module")
def agent_preset(tiny_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> str:
    """The tiny n-gram preset, its target's template one that renders tools and tool calls."""
    folder = tmp_path_factory.mktemp("agent-model")
    shutil.copytree(tiny_folders["target"], folder / "target")
    tokenizer = AutoTokenizer.from_pretrained(folder / "target")
    tokenizer.chat_template = AGENT_TEMPLATE
    tokenizer.save_pretrained(folder / "target")
    return write_preset(folder, folder / "target")


def test_agent_rows_offer_tools_and_render_tool_calls(
        capsys: pytest.CaptureFixture[str], agent_preset: str, tmp_path: Path) -> None:
    """A row with tools and tool calls goes through the chat template with its tools offered
    and each call's arguments an object (an OpenAI-style JSON string is parsed first: a
    template given the string would render it quoted); bench runs it."""
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps(AGENT_ROW) + "\n", encoding="utf-8")
    rows = load_prompts(str(path))
    call = rows[0]["messages"][1]
    assert call["content"] == ""
    assert call["tool_calls"][0]["function"]["arguments"] == {"path": "add.py"}
    pipe = Pipeline.load(load_preset(agent_preset))
    text = pipe.tokenizer.decode(encode_prompts(pipe, rows, 4)[0])
    assert text.startswith('<|tools|>{"type": "function", "function": {"name": "read_file"')
    assert '<|assistant|><call>read_file {"path": "add.py"}</call>\n' in text
    assert text.endswith("<|tool|>def add(a, b):\n    return a - b\n\n<|assistant|>")
    code, out, err = run_cli(capsys, "bench", "--preset", agent_preset, "--prompts", str(path),
                             "--methods", "ngram", "--max-new-tokens", "4")
    assert code == 0, err
    assert "agent" in out and "NO" not in out


def test_agent_transcript_is_one_growing_session() -> None:
    """The shipped agent transcript: one session, each row's history the last row's plus one
    assistant turn and its tool results; the write_file call re-emits the whole file."""
    rows = load_prompts(str(REPO / "localspec" / "data" / "agent_transcript.jsonl"))
    assert [r["category"] for r in rows] == ["agent 1: read_file", "agent 2: write_file",
                                             "agent 3: run_tests", "agent 4: answer"]
    for before, after in itertools.pairwise(rows):
        assert after["messages"][:len(before["messages"])] == before["messages"]
        assert [m["role"] for m in after["messages"][len(before["messages"]):]] == [
            "assistant", "tool"]
        assert after["tools"] == before["tools"]
    read, write = (rows[i]["messages"][-2]["tool_calls"][0]["function"] for i in (1, 2))
    assert read["name"] == "read_file" and write["name"] == "write_file"
    original = rows[1]["messages"][-1]["content"]
    assert write["arguments"]["content"].count("\n") == original.count("\n") + 2 >= 50
    assert rows[3]["messages"][-1]["content"].endswith("7 passed")


def test_bad_presets_are_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [unclosed\n", encoding="utf-8")
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('name = "x"\ndescription = "y"\nhardware = "cpu"\n[target]\nmodel = 3\n',
                     encoding="utf-8")
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    missing = tmp_path / "gone.toml"
    missing.write_text('name = "x"\ndescription = "y"\nhardware = "cpu"\n[target]\nmodel = '
                       f'"{tmp_path / "no-such-model"}"\n', encoding="utf-8")
    for preset, needle in (("no-such-preset", "unknown preset"), (str(broken), "not valid TOML"),
                           (str(wrong), "[target] model"), (str(folder), "it is a folder")):
        assert_user_error(run_cli(capsys, "export-vllm", preset), needle)
        assert_user_error(run_cli(capsys, "generate", "--preset", preset, "--prompt", "hi"),
                          needle)
    code, _, err = run_cli(capsys, "generate", "--preset", str(missing), "--prompt", "hi")
    assert code == 2 and "Traceback" not in err and "no-such-model" in err




# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(("prompt", "needle"), [
    # what Python makes of the bytes b"hi\xed\xa0\x80\xff end" in an argument
    ("hi\udced\udca0\udc80\udcff end", "--prompt: the byte 0xed is not UTF-8 (character 3) "
                                       "(and 3 more)"),
    ("hi \ud800", "--prompt: U+D800 is a lone surrogate, not a character (character 4)"),
])
@pytest.mark.usefixtures("no_loading")
def test_prompt_that_is_not_unicode_is_refused(capsys: pytest.CaptureFixture[str],
                                               presets: dict[str, str], prompt: str,
                                               needle: str) -> None:
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["ngram"], "--prompt",
                              prompt), needle)


def test_real_process_with_a_prompt_that_is_not_utf8(presets: dict[str, str],
                                                     tmp_path: Path) -> None:
    """The bytes of issue 19 as a real argument: one line naming the byte, exit 2."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "--preset",
                          presets["ngram"], "--prompt", b"hi\xed\xa0\x80\xff end"],
                         capture_output=True, cwd=REPO, env=_env(tmp_path), timeout=300)
    err = out.stderr.decode("utf-8")
    assert out.returncode == 2 and "Traceback" not in err, err
    assert err.startswith("localspec: error: --prompt: the byte 0xed is not UTF-8"), err


# ----------------------------------------------------------------------------- presets


def test_missing_and_unknown_presets_say_what_is_wrong(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    shipped = ", ".join(list_preset_names())
    missing = tmp_path / "nope.toml"
    for args in (["export-vllm", str(missing)], ["generate", "--preset", str(missing),
                                                 "--prompt", "hi"]):
        code, _, err = run_cli(capsys, *args)
        assert_user_error((code, "", err), f"{missing}: no such file")
        assert "not a .toml file" not in err
    assert_user_error(run_cli(capsys, "export-vllm", "nope.toml"),
                      "nope.toml: no such file, and no shipped preset is called nope", shipped)
    assert_user_error(run_cli(capsys, "export-vllm", "nope"),
                      "unknown preset 'nope'", shipped, "a path ending in .toml")


@pytest.mark.parametrize(("text", "needle"), [
    ("a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('name = "x"\n[sampling]\nseed = ' + "9" * 5000,
     f"more than {sys.get_int_max_str_digits()} digits"),
], ids=["deep-nesting", "5000-digits"])
def test_preset_toml_the_parser_cannot_hold(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    assert_user_error(run_cli(capsys, "export-vllm", str(path)), str(path), needle)


@pytest.mark.parametrize(("text", "needle"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "digits"),
    ('{"architectures": ["\\ud800"]}', "lone surrogate"),
], ids=["deep-nesting", "5000-digits", "surrogate"])
def test_head_config_the_parser_cannot_hold(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ModelLoadError, match=needle):
        read_config(tmp_path)


# ----------------------------------------------------------------------------- bugs


class Unprintable(Exception):
    """An exception whose message cannot even be made."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


@pytest.mark.parametrize(("error", "summary"), [
    (ValueError("bad \udcff text \ud800"), "ValueError: bad \\udcff text \\ud800"),
    (Unprintable(), "Unprintable"),
], ids=["surrogates", "unprintable"])
def test_crash_log_takes_any_exception(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch, own_cache: Path,
                                       error: Exception, summary: str) -> None:
    """The crash logger cannot crash: any message (lone surrogates, a __str__ that raises)
    gives one line naming the log, and the log holds the traceback."""

    def boom(_args: object) -> int:
        raise error

    monkeypatch.setattr("localspec.cli.main._cmd_presets", boom)
    code, _, err = run_cli(capsys, "presets")
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith(f"localspec: internal error: {summary} (details: "), err
    (log,) = (own_cache / "logs").glob("crash-*.log")
    assert "Traceback" in log.read_text(encoding="utf-8")


def test_output_that_is_not_unicode_is_escaped_not_a_crash(tmp_path: Path) -> None:
    """A name that is not UTF-8 (a file name, say) reaching stdout is printed escaped, as
    Python prints it on stderr: JSON stays valid, nothing crashes."""
    code = ("import json, sys\nimport localspec.cli.main as m\n"
            "m._cmd_presets = lambda _args: print(json.dumps({'name': 'a\\udcffb'}, "
            "ensure_ascii=False)) or 0\nsys.exit(m.main(['presets']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO,
                         env=_env(tmp_path), timeout=300)
    assert out.returncode == 0 and out.stderr == b"", out.stderr
    assert json.loads(out.stdout) == {"name": "a\udcffb"}
