"""The app's handlers on the small real model (SmolLM2-135M, n-gram preset), for what only a
real model shows: copying text with coloured tokens, multi-turn answers and Regenerate, the
context limit, Stop within a step, preset switches that fail, refuse a foreign tokenizer or
reuse the target, and race mode. One app is loaded for the module. Anything logged at ERROR
fails a test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from app_helpers import HISTORY, final, is_skip, settings

from localspec.host import ModelHost
from localspec.models.hardware import detect_hardware
from localspec.ui.app import CHAT_OUTPUTS, RACE_OUTPUTS, SWITCH_OUTPUTS, ChatApp

pytestmark = pytest.mark.usefixtures("no_errors_logged")

SMOL = "cpu-smollm2-ngram"
COPY_PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near "
               "the river bank.")


@pytest.fixture(scope="module")
def app() -> ChatApp:
    host = ModelHost()
    assert host.load(SMOL), host.status().error
    return ChatApp(host, detect_hardware(), SMOL, min_update_interval=0.0, stop_wait_s=0.0)


@pytest.fixture
def smol(app: ChatApp) -> Iterator[ChatApp]:
    """The app with the SmolLM2 preset active (a test may switch away; it is put back)."""
    if app.host.status().active != SMOL:
        assert app.host.load(SMOL)
    yield app


@pytest.mark.real_model
def test_chat_streams_coloured_tokens_and_stats(smol: ChatApp) -> None:
    outputs = list(smol.chat.send(COPY_PROMPT, [], settings()))
    assert len(outputs) >= 3  # the user's message at once, then the streamed answer
    first = dict(zip(CHAT_OUTPUTS, outputs[0], strict=True))
    assert first["history"][-1] == {"role": "user", "content": COPY_PROMPT}
    assert first["message"] == ""
    out = final(outputs)
    history = out["history"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    answer = history[-1]["content"]
    assert "quick brown fox" in answer
    assert "quick brown fox" in out["chat"] and 'class="ls-msg ls-assistant"' in out["chat"]
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


@pytest.mark.real_model
def test_multi_turn_system_prompt_and_regenerate(smol: ChatApp) -> None:
    terse = settings(system="You are terse.")
    first = final(list(smol.chat.send("What is 2 + 2? Answer with one number.", [], terse)))
    history = first["history"]
    second = final(list(smol.chat.send("And 3 + 3?", history, terse)))
    assert [m["role"] for m in second["history"]] == ["user", "assistant"] * 2
    assert second["history"][:2] == history
    again = final(list(smol.chat.regenerate(second["history"], terse)))
    assert again["history"] == second["history"]  # greedy: the same answer again
    nothing = final(list(smol.chat.regenerate([], settings())))
    assert "Nothing to regenerate yet." in nothing["notice"]


@pytest.mark.real_model
def test_empty_message_is_refused_politely(smol: ChatApp) -> None:
    outputs = list(smol.chat.send("   ", HISTORY, settings()))
    assert len(outputs) == 1
    out = final(outputs)
    assert is_skip(out["history"]) and "empty message" in out["notice"]


@pytest.mark.real_model
def test_prompt_over_the_context_is_an_error_and_the_text_comes_back(smol: ChatApp) -> None:
    long = "word " * 9000  # SmolLM2 holds 8192 tokens
    out = final(list(smol.chat.send(long, HISTORY, settings())))
    assert "context" in out["notice"] and "⚠" in out["notice"]
    assert out["history"] == HISTORY and out["message"] == long  # nothing lost


@pytest.mark.real_model
def test_draft_method_without_a_draft_model_says_why(smol: ChatApp) -> None:
    out = final(list(smol.chat.send("hello", [], settings(method="draft_model"))))
    assert "needs a draft model" in out["notice"]
    assert out["history"] == [] and out["message"] == "hello"


@pytest.mark.real_model
def test_stop_cancels_within_a_step(smol: ChatApp) -> None:
    stream = smol.chat.send("Write a long story about a dragon.", [],
                       settings(max_new_tokens=400, method="none"))
    streamed = [next(stream) for _ in range(4)]  # user message, then three steps
    assert "Stopping after the current step" in smol.turns.stop()
    rest = list(stream)
    assert len(rest) <= 2  # at most the step under way, then the final update
    out = final(streamed + rest)
    assert "Stopped." in out["notice"]
    assert "stopped: cancelled" in out["summary"]
    assert len(out["spans"]) < 20 and out["history"][-1]["content"]
    assert "Nothing to stop." in smol.turns.stop()
    assert not smol.host.generation_lock.locked()


@pytest.mark.real_model
def test_broken_and_missing_presets_keep_the_previous_one(smol: ChatApp, tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "broken"\n[target\n', encoding="utf-8")
    out = final(list(smol.presets.switch(str(broken))), SWITCH_OUTPUTS)
    assert "could not load preset" in out["status"] and "not valid TOML" in out["status"]
    assert "Active preset" in out["status"] and out["preset"] == SMOL

    missing = tmp_path / "missing.toml"
    missing.write_text('name = "m"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                       f'model = "{tmp_path / "no-such-model.gguf"}"\n', encoding="utf-8")
    out = final(list(smol.presets.switch(str(missing))), SWITCH_OUTPUTS)
    assert "GGUF file not found" in out["status"]
    assert smol.host.status().active == SMOL
    # ... and chat goes on with the previous preset.
    answer = final(list(smol.chat.send(COPY_PROMPT, [], settings(max_new_tokens=8))))
    assert answer["history"][-1]["content"]


@pytest.mark.real_model
def test_foreign_tokenizer_draft_is_refused(smol: ChatApp, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.toml"
    foreign.write_text('name = "f"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                       'model = "smollm2-135m-instruct"\ndtype = "bfloat16"\n'
                       '[speculative_config]\nmethod = "draft_model"\n'
                       'model = "qwen2.5-coder-0.5b-instruct"\n', encoding="utf-8")
    out = final(list(smol.presets.switch(str(foreign))), SWITCH_OUTPUTS)
    assert "different tokenizer" in out["status"]
    assert smol.host.status().active == SMOL


@pytest.mark.real_model
def test_switch_reuses_the_target_and_keeps_the_conversation(smol: ChatApp,
                                                            tmp_path: Path) -> None:
    target = smol.host.pipeline.target
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "SmolLM2 plain"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                     'model = "smollm2-135m-instruct"\ndtype = "bfloat16"\nquantization = "w8a8"\n'
                     '[sampling]\n'
                     "temperature = 0.5\nmax_new_tokens = 77\n", encoding="utf-8")
    out = final(list(smol.presets.switch(str(plain))), SWITCH_OUTPUTS)
    assert "SmolLM2 plain" in out["status"] and "ls-error" not in out["status"]
    assert smol.host.pipeline.target is target  # only the method changed: no reload
    assert out["temperature"] == 0.5 and out["max_new_tokens"] == 77
    reply = final(list(smol.chat.send("Say hi again.", HISTORY, settings(max_new_tokens=8))))
    assert reply["history"][:2] == HISTORY and "none" in reply["summary"]


@pytest.mark.real_model
def test_race_mode(smol: ChatApp) -> None:
    out = final(list(smol.race.run(COPY_PROMPT, settings())), RACE_OUTPUTS)
    assert "identical: <b>yes</b>" in out["race"] and "speedup" in out["race"]
    assert "plain decoding (none)" in out["race"] and "speculative (ngram)" in out["race"]
    refused = final(list(smol.race.run(COPY_PROMPT, settings(method="none"))), RACE_OUTPUTS)
    assert "Pick a speculative method" in refused["notice"]
