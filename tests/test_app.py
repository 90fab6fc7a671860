"""The app built in-process on the small real model (SmolLM2-135M, n-gram preset): its handlers
are plain generators, called here as Gradio would call them, without a browser."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from localspec.models.hardware import detect_hardware
from localspec.ui.app import CHAT_OUTPUTS, RACE_OUTPUTS, SWITCH_OUTPUTS, ChatApp
from localspec.ui.host import ModelHost

pytestmark = pytest.mark.real_model
SMOL = "cpu-smollm2-ngram"
COPY_PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near "
               "the river bank.")


def settings(**overrides: object) -> list[object]:
    """system, method, temperature, top_p, top_k, max_new_tokens, k, seed, show_rejected"""
    values = {"system": "", "method": "preset", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
              "max_new_tokens": 48, "k": 8, "seed": 0, "show_rejected": True}
    values.update(overrides)
    return list(values.values())


def final(outputs: list[tuple], names: tuple[str, ...] = CHAT_OUTPUTS) -> dict[str, object]:
    return dict(zip(names, outputs[-1], strict=True))


def session(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=name)


@pytest.fixture(scope="module")
def app() -> ChatApp:
    host = ModelHost()
    assert host.load(SMOL), host.status().error
    chat_app = ChatApp(host, detect_hardware(), SMOL, min_update_interval=0.0)
    assert isinstance(chat_app.build(), gr.Blocks)
    return chat_app


@pytest.fixture
def smol(app: ChatApp) -> Iterator[ChatApp]:
    """The app with the SmolLM2 preset active (a test may switch away; it is put back)."""
    if app.host.status().active != SMOL:
        assert app.host.load(SMOL)
    yield app


def test_chat_streams_coloured_tokens_and_stats(smol: ChatApp) -> None:
    outputs = list(smol.chat(COPY_PROMPT, [], *settings()))
    assert len(outputs) >= 3  # the user's message at once, then the streamed answer
    first = dict(zip(CHAT_OUTPUTS, outputs[0], strict=True))
    assert first["history"][-1] == {"role": "user", "content": COPY_PROMPT}
    assert first["message"] == ""
    out = final(outputs)
    history = out["history"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    answer = history[-1]["content"]
    assert "quick brown fox" in answer
    assert "<span" not in answer  # the chat keeps plain text: copyable without markup
    tokens = out["tokens"]
    assert "ls-accepted" in tokens  # the n-gram drafter copies the sentence
    kinds = set(re.findall(r'class="ls-tok ls-(\w+)"', tokens))
    assert kinds <= {"accepted", "recovered", "bonus", "target", "rejected"}
    assert "tokens/s (average)" in out["stats"] and "acceptance rate" in out["stats"]
    assert "tok/s" in out["summary"] and "ngram" in out["summary"]
    # Same tokens as plain decoding of the same prompt (greedy speculation is lossless).
    pipe = smol.host.pipeline
    ids = pipe.encode_chat([{"role": "user", "content": COPY_PROMPT}])
    plain = pipe.run(pipe.request(ids, max_new_tokens=48), "none")
    assert answer == plain.text
    visible = "".join(s.text for s in out["spans"] if s.kind != "rejected")
    assert visible == answer  # the coloured view reads exactly as the plain text


def test_multi_turn_system_prompt_and_regenerate(smol: ChatApp) -> None:
    first = final(list(smol.chat("What is 2 + 2? Answer with one number.", [],
                                 *settings(system="You are terse."))))
    history = first["history"]
    second = final(list(smol.chat("And 3 + 3?", history, *settings(system="You are terse."))))
    assert [m["role"] for m in second["history"]] == ["user", "assistant"] * 2
    assert second["history"][:2] == history
    again = final(list(smol.regenerate(second["history"], *settings(system="You are terse."))))
    assert again["history"] == second["history"]  # greedy: the same answer again
    assert final(list(smol.regenerate([], *settings())))["notice"] == "Nothing to regenerate yet."


def test_empty_message_is_refused_politely(smol: ChatApp) -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    outputs = list(smol.chat("   ", history, *settings()))
    assert len(outputs) == 1
    out = final(outputs)
    assert out["history"] == history and "empty message" in out["notice"]


def test_prompt_over_the_context_is_an_error_and_the_text_comes_back(smol: ChatApp) -> None:
    long = "word " * 9000  # SmolLM2 holds 8192 tokens
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    out = final(list(smol.chat(long, history, *settings())))
    assert "context" in out["notice"] and out["notice"].startswith("⚠")
    assert out["history"] == history and out["message"] == long  # nothing lost


def test_draft_method_without_a_draft_model_says_why(smol: ChatApp) -> None:
    out = final(list(smol.chat("hello", [], *settings(method="draft_model"))))
    assert "needs a draft model" in out["notice"]


def test_stop_cancels_within_a_step(smol: ChatApp) -> None:
    stream = smol.chat("Write a long story about a dragon.", [],
                       *settings(max_new_tokens=400, method="none"))
    streamed = [next(stream) for _ in range(4)]  # user message, notice, two tokens
    assert smol.stop() == "Stopping after the current step…"
    rest = list(stream)
    assert len(rest) <= 2  # at most the step under way, then the final update
    out = final(streamed + rest)
    assert out["notice"] == "Stopped."
    assert "stopped: cancelled" in out["summary"]
    assert len(out["spans"]) < 20
    assert smol.stop() == "Nothing to stop."
    assert not smol.host.generation_lock.locked()


def test_second_session_waits_and_is_told(smol: ChatApp) -> None:
    first = smol.chat(COPY_PROMPT, [], *settings(), request=session("a"))
    for _ in range(3):
        next(first)  # now holds the generation lock
    second = smol.chat("hello", [], *settings(max_new_tokens=8), request=session("b"))
    next(second)  # the user's message
    waiting = dict(zip(CHAT_OUTPUTS, next(second), strict=True))
    assert waiting["notice"].startswith("⏳ Waiting: another tab is generating")
    assert smol.host.status().waiting == 1
    first_out = final(list(first))  # the first finishes untouched ...
    assert "quick brown fox" in first_out["history"][-1]["content"]
    second_out = final(list(second))  # ... then the second runs
    assert second_out["history"][-1]["role"] == "assistant" and second_out["notice"] == ""
    assert smol.host.status().waiting == 0


def test_broken_and_missing_presets_keep_the_previous_one(smol: ChatApp, tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "broken"\n[target\n', encoding="utf-8")
    out = final(list(smol.switch_preset(str(broken))), SWITCH_OUTPUTS)
    assert "could not load preset" in out["status"] and "not valid TOML" in out["status"]
    assert "Active preset" in out["status"] and out["preset"] == SMOL

    missing = tmp_path / "missing.toml"
    missing.write_text('name = "m"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                       f'model = "{tmp_path / "no-such-model.gguf"}"\n', encoding="utf-8")
    out = final(list(smol.switch_preset(str(missing))), SWITCH_OUTPUTS)
    assert "GGUF file not found" in out["status"]
    assert smol.host.status().active == SMOL
    # ... and chat goes on with the previous preset.
    answer = final(list(smol.chat(COPY_PROMPT, [], *settings(max_new_tokens=8))))
    assert answer["history"][-1]["content"]


def test_foreign_tokenizer_draft_is_refused(smol: ChatApp, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.toml"
    foreign.write_text('name = "f"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                       'model = "smollm2-135m-instruct"\ndtype = "bfloat16"\n'
                       '[speculative_config]\nmethod = "draft_model"\n'
                       'model = "qwen2.5-coder-0.5b-instruct"\n', encoding="utf-8")
    out = final(list(smol.switch_preset(str(foreign))), SWITCH_OUTPUTS)
    assert "different tokenizer" in out["status"]
    assert smol.host.status().active == SMOL


def test_switch_reuses_the_target_and_keeps_the_conversation(smol: ChatApp,
                                                            tmp_path: Path) -> None:
    target = smol.host.pipeline.target
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "SmolLM2 plain"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                     'model = "smollm2-135m-instruct"\ndtype = "bfloat16"\n[sampling]\n'
                     "temperature = 0.5\nmax_new_tokens = 77\n", encoding="utf-8")
    out = final(list(smol.switch_preset(str(plain))), SWITCH_OUTPUTS)
    assert "SmolLM2 plain" in out["status"] and ".ls-error" not in out["status"]
    assert smol.host.pipeline.target is target  # only the method changed: no reload
    assert out["temperature"] == 0.5 and out["max_new_tokens"] == 77
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    reply = final(list(smol.chat("Say hi again.", history, *settings(max_new_tokens=8))))
    assert reply["history"][:2] == history and "none" in reply["summary"]


def test_race_mode(smol: ChatApp) -> None:
    outputs = list(smol.race(COPY_PROMPT, *settings()))
    out = final(outputs, RACE_OUTPUTS)
    assert "identical: <b>yes</b>" in out["race"] and "speedup" in out["race"]
    assert "plain decoding (none)" in out["race"] and "speculative (ngram)" in out["race"]
    refused = final(list(smol.race(COPY_PROMPT, *settings(method="none"))), RACE_OUTPUTS)
    assert "Pick a speculative method" in refused["notice"]
    assert "Type a prompt" in final(list(smol.race(" ", *settings())), RACE_OUTPUTS)["notice"]


def test_show_rejected_toggle_and_clear(smol: ChatApp) -> None:
    out = final(list(smol.chat(COPY_PROMPT, [], *settings())))
    spans = out["spans"]
    if any(s.kind == "rejected" for s in spans):
        assert "ls-rejected" in smol.rerender(spans, True)
    assert "ls-rejected" not in smol.rerender(spans, False)
    cleared = dict(zip(CHAT_OUTPUTS, smol.clear(), strict=True))
    assert cleared["history"] == [] and cleared["spans"] == []


def test_no_model_loaded_says_so_and_keeps_the_message() -> None:
    """A start with a preset that cannot load: the page works and says what to do."""
    host = ModelHost()
    assert not host.load("no-such-preset")
    app = ChatApp(host, detect_hardware(), "no-such-preset")
    assert isinstance(app.build(), gr.Blocks)
    assert "No model loaded" in app.status() and "unknown preset" in app.status()
    outputs = list(app.chat("hello", [], *settings()))
    notices = [o[CHAT_OUTPUTS.index("notice")] for o in outputs]
    last_notice = [n for n in notices if isinstance(n, str)][-1]
    assert "No model is loaded" in last_notice and "unknown preset" in last_notice
    out = final(outputs)
    assert out["history"] == [] and out["message"] == "hello"
