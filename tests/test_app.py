"""The app's handlers, in-process, called as Gradio calls them (no browser).

Two apps: one on tiny random models with a byte-level tokenizer (fast, no checkpoint: failures,
refusals, concurrency, the layout's limits), and one on the small real model (SmolLM2-135M,
n-gram preset) for what only a real model shows: copying text, multi-turn answers, the context
limit, preset switches. Anything logged at ERROR fails a test unless it expects a bug.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import gradio as gr
import orjson
import pytest
from conftest import CHAT_TEMPLATE, TOKENIZER_TEXTS, make_tiny_model, train_tokenizer, write_preset

from localspec.config import (
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_SPECULATIVE_TOKENS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SLIDER_MAX,
)
from localspec.engine.engine import StepEvent
from localspec.models.hardware import detect_hardware
from localspec.pipeline import Pipeline
from localspec.ui.app import CHAT_OUTPUTS, RACE_OUTPUTS, SWITCH_OUTPUTS, ChatApp, Settings
from localspec.ui.host import ModelHost
from localspec.ui.layout import SLIDERS, build, setting_range

SMOL = "cpu-smollm2-ngram"
COPY_PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near "
               "the river bank.")


def settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                 "max_new_tokens": 48, "k": 8, "seed": 0}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def final(outputs: list[tuple], names: tuple[str, ...] = CHAT_OUTPUTS) -> dict[str, object]:
    return dict(zip(names, outputs[-1], strict=True))


def is_skip(value: object) -> bool:
    return value == gr.skip()


@pytest.fixture
def expects_bug() -> None:
    """Marks a test that injects a bug: an ERROR with its traceback is expected in the log."""


@pytest.fixture(autouse=True)
def _no_errors_logged(caplog: pytest.LogCaptureFixture,
                      request: pytest.FixtureRequest) -> Iterator[None]:
    """A traceback in the server log is a failure, unless the test expects a bug."""
    yield
    if "expects_bug" not in request.fixturenames:
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def tiny_presets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Preset files over a tiny target: n-gram, plain, and a random (always wrong) draft."""
    root = tmp_path_factory.mktemp("ui-tiny")
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    for name, seed in (("target", 0), ("draft", 1)):
        make_tiny_model(seed=seed, vocab_size=300).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {key: write_preset(root, root / "target", draft, method, k=4, max_new_tokens=12,
                              adaptive=False)
            for key, method, draft in (("ngram", "ngram", None), ("plain", "none", None),
                                       ("draft", "draft_model", root / "draft"))}


@pytest.fixture
def tiny(tiny_presets: dict[str, str]) -> ChatApp:
    host = ModelHost(warm_up=False)
    assert host.load(tiny_presets["ngram"]), host.status().error
    # The tests drive the answers' generators from the calling thread, so a Stop there could
    # only time out waiting for them to end: it does not wait.
    return ChatApp(host, detect_hardware(), tiny_presets["ngram"], min_update_interval=0.0,
                   stop_wait_s=0.0)


def failing_stream(pipe: Pipeline, after: int, error: Exception) -> Callable[..., Iterator]:
    """``pipe.stream`` that yields ``after`` real events, then raises ``error``."""
    real = pipe.stream

    def stream(request: object, method: str | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> Iterator[StepEvent]:
        events = real(request, method, cancelled)

        def failing() -> Iterator[StepEvent]:
            for _ in range(after):
                yield next(events)
            raise error

        return failing()

    return stream


def scripted_stream(pipe: Pipeline, text: str) -> Callable[..., Iterator[StepEvent]]:
    """``pipe.stream`` whose answer is ``text``, one token a step (the browser test uses it to
    know what the assistant says)."""
    ids = pipe.tokenizer.encode(text, add_special_tokens=False)

    def stream(request: object, method: str | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> Iterator[StepEvent]:
        said = ""
        for step, token in enumerate(ids, 1):
            now = pipe.tokenizer.decode(ids[:step], skip_special_tokens=True)
            finish = "length" if step == len(ids) else "cancelled" if cancelled() else None
            yield StepEvent(step, 0, (), 0, token, "bonus", (token,), (1.0,), (),
                            now[len(said):], 0.0, 0.0, finish)
            said = now
            if finish is not None:
                return

    return stream


def test_scripted_stream_says_its_text(tiny: ChatApp) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = scripted_stream(pipe, "def add(a, b):\n    return a + b\n")
    try:
        out = final(list(tiny.chat("hello", [], settings())))
    finally:
        del pipe.stream
    assert out["history"][-1] == {"role": "assistant",
                                  "content": "def add(a, b):\n    return a + b\n"}


HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.mark.parametrize(("overrides", "named"), [
    ({"temperature": math.nan}, "temperature"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": math.nan}, "seed"),
    ({"k": 0}, "num_speculative_tokens"),
    ({"k": math.nan}, "num_speculative_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
    ({"method": "telepathy"}, "unknown method"),
])
def test_refused_settings_give_the_message_back(tiny: ChatApp, overrides: dict,
                                                named: str) -> None:
    """A value the pipeline refuses: a notice naming it, the user's turn taken back, the text
    back in the box, no traceback (the autouse fixture checks the log)."""
    outputs = list(tiny.chat("hello <b>there</b>", HISTORY, settings(**overrides)))
    out = final(outputs)
    assert named in out["notice"] and "⚠" in out["notice"], out["notice"]
    assert out["history"] == HISTORY and out["message"] == "hello <b>there</b>"
    assert "back in the box" in out["notice"]
    assert "hello" not in out["chat"]  # the chat view shows the old conversation only


def test_failure_mid_answer_keeps_the_partial_answer(tiny: ChatApp, expects_bug: None,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 3, RuntimeError("boom"))
    try:
        outputs = list(tiny.chat("def add", HISTORY, settings(method="none")))
    finally:
        del pipe.stream
    out = final(outputs)
    history = out["history"]
    assert history[:3] == [*HISTORY, {"role": "user", "content": "def add"}]
    assert history[-1]["role"] == "assistant" and history[-1]["content"].strip()
    assert "The generation failed" in out["notice"] and "server log" in out["notice"]
    assert "boom" not in out["notice"]  # a bug's details go to the log, not to the user
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    # No output ever carried an empty assistant turn.
    for o in outputs:
        turns = dict(zip(CHAT_OUTPUTS, o, strict=True))["history"]
        if not is_skip(turns):
            assert all(m["content"] for m in turns if m["role"] == "assistant")


def test_failure_before_any_token_gives_the_message_back(tiny: ChatApp,
                                                        expects_bug: None) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 0, RuntimeError("boom"))
    try:
        out = final(list(tiny.chat("hello", HISTORY, settings())))
    finally:
        del pipe.stream
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "boom" not in out["notice"] and "server log" in out["notice"]


def test_expected_failure_mid_answer_is_shown_without_a_traceback(tiny: ChatApp) -> None:
    from localspec.errors import ModelLoadError

    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 3, ModelLoadError("the model file went away"))
    try:
        out = final(list(tiny.chat("def add", [], settings(method="none"))))
    finally:
        del pipe.stream
    assert "the model file went away" in out["notice"]
    assert out["history"][-1]["role"] == "assistant"


def sendable(outputs: list[tuple]) -> None:
    """Every view serializes as Gradio sends it (orjson: UTF-8, no lone surrogates)."""
    for output in outputs:
        orjson.dumps([value for value in output if not is_skip(value)], default=str)


NOT_UNICODE = "hi \ud800 there \udcff"  # lone surrogates: what a browser can send for bad text


def test_message_that_is_not_unicode_is_refused_and_shown_replaced(tiny: ChatApp) -> None:
    """The message comes back into the box with U+FFFD where it held lone surrogates, and a
    notice says so; nothing is sent to the model, and every view can be sent to the page."""
    outputs = list(tiny.chat(NOT_UNICODE, HISTORY, settings()))
    sendable(outputs)
    out = final(outputs)
    assert out["message"] == "hi \ufffd there \ufffd"
    assert "2 characters that are not valid Unicode" in out["notice"]
    assert "⚠" in out["notice"] and is_skip(out["history"])


@pytest.mark.parametrize("where", ["system", "history"])
def test_system_prompt_or_history_that_is_not_unicode_is_refused(tiny: ChatApp,
                                                                 where: str) -> None:
    history = [{"role": "user", "content": NOT_UNICODE}] if where == "history" else HISTORY
    system = NOT_UNICODE if where == "system" else ""
    for outputs in (list(tiny.chat("hello", history, settings(system=system))),
                    list(tiny.regenerate(history, settings(system=system)))):
        sendable(outputs)
        out = final(outputs)
        needle = "system prompt" if where == "system" else "conversation"
        assert needle in out["notice"] and "not valid Unicode" in out["notice"], out["notice"]
        assert is_skip(out["message"])  # the box keeps what the user typed
    race = list(tiny.race(NOT_UNICODE, settings(system=system)))
    sendable(race)
    assert "not valid Unicode" in final(race, RACE_OUTPUTS)["notice"]


def test_preset_path_that_is_not_unicode_is_a_failed_switch(tiny: ChatApp) -> None:
    active = tiny.host.status().active
    outputs = list(tiny.switch_preset("my\udcffpreset.toml"))
    sendable(outputs)
    assert "my\ufffdpreset.toml: no such file" in final(outputs, SWITCH_OUTPUTS)["status"]
    assert tiny.host.status().active == active


def test_regenerate_refused_brings_the_old_answer_back(tiny: ChatApp) -> None:
    out = final(list(tiny.regenerate(HISTORY, settings(temperature=math.nan))))
    assert out["history"] == HISTORY and "temperature" in out["notice"]
    assert is_skip(out["message"])  # regenerate leaves the box alone


def test_stop_before_the_first_token_leaves_no_empty_turn(tiny: ChatApp) -> None:
    """Stop as the generation starts: the engine ends with no token; no empty turn stays."""
    pipe = tiny.host.pipeline
    real = pipe.stream

    def stopped_at_once(*args: object, **kwargs: object) -> Iterator[StepEvent]:
        assert "Stopping" in tiny.stop("s")
        return real(*args, **kwargs)

    pipe.stream = stopped_at_once
    try:
        stream = tiny.chat("hello", HISTORY, settings(), session="s")
        first = dict(zip(CHAT_OUTPUTS, next(stream), strict=True))
        assert first["history"][-1] == {"role": "user", "content": "hello"}
        assert "is answering" in first["chat"]
        out = final(list(stream))
    finally:
        del pipe.stream
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "Stopped before the first token" in out["notice"]
    assert "stopped: cancelled" in out["summary"]


def test_stop_while_waiting_for_the_models(tiny: ChatApp) -> None:
    stream = tiny.chat("hello", HISTORY, settings(), session="s")
    next(stream)
    assert "Stopping" in tiny.stop("s")
    out = final(list(stream))
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "Stopped while waiting" in out["notice"]


def test_draft_rejections_are_shown_and_hidden(tiny: ChatApp,
                                               tiny_presets: dict[str, str]) -> None:
    """A random draft model against the target: rejected drafts certainly occur."""
    assert tiny.host.load(tiny_presets["draft"])
    out = final(list(tiny.chat("def add(a, b):", [], settings(k=4))))
    spans = out["spans"]
    rejected = [s for s in spans if s.kind == "rejected"]
    assert rejected, [s.kind for s in spans]
    assert "ls-rejected" in out["tokens"]
    shown = tiny.rerender(spans, True)
    assert shown.count("ls-tok ls-rejected") == len(rejected)
    hidden = tiny.rerender(spans, False)
    assert "ls-rejected" not in hidden
    assert hidden.count("ls-tok ") == len(spans) - len(rejected)
    cleared = dict(zip(CHAT_OUTPUTS, tiny.clear(), strict=True))
    assert cleared["history"] == [] and cleared["spans"] == []
    assert "No messages yet" in cleared["chat"]


def test_two_sessions_and_stop_while_waiting(tiny: ChatApp) -> None:
    first = tiny.chat("def add", [], settings(method="none"), session="a")
    next(first), next(first)  # "a" now generates and holds the lock
    second = tiny.chat("hello", HISTORY, settings(), session="b")
    next(second)
    waiting = dict(zip(CHAT_OUTPUTS, next(second), strict=True))
    assert "another tab is generating" in waiting["notice"]
    assert tiny.stop("b").count("Stopping") == 1
    out_b = final(list(second))
    assert "Stopped while waiting" in out_b["notice"] and out_b["message"] == "hello"
    assert out_b["history"] == HISTORY
    third = tiny.chat("hello", [], settings(max_new_tokens=12), session="c")
    next(third), next(third)  # "c" waits its turn
    out_a = final(list(first))  # "a" was not disturbed
    assert out_a["history"][-1]["role"] == "assistant" and out_a["notice"] == ""
    out_c = final(list(third))  # ... and "c" then answers, as it would alone
    pipe = tiny.host.pipeline
    alone = pipe.run(pipe.request(pipe.encode_chat([{"role": "user", "content": "hello"}]),
                                  max_new_tokens=12, temperature=0.0))
    assert out_c["history"][-1] == {"role": "assistant", "content": alone.text}
    assert not tiny.host.generation_lock.locked() and tiny.host.status().waiting == 0


def test_stop_leaves_the_notice_to_the_answers_last_update(tiny: ChatApp) -> None:
    """Stop's reply and the answer's last update reach the page in either order; a Stop that
    sees the answer end within its wait sends nothing, so "Stopped." is what stays."""
    tiny.stop_wait_s = 30.0
    updates: list[tuple] = []
    stepping = threading.Event()

    def consume() -> None:
        for update in tiny.chat("def add", [], settings(method="none", max_new_tokens=400),
                                session="s"):
            updates.append(update)
            if len(updates) >= 3:
                stepping.set()

    answering = threading.Thread(target=consume)
    answering.start()
    assert stepping.wait(60)
    assert is_skip(tiny.stop("s"))
    answering.join(10)
    assert not answering.is_alive()
    out = final(updates)
    assert "Stopped." in out["notice"] and "stopped: cancelled" in out["summary"]
    assert "Nothing to stop" in tiny.stop("s")


def test_stop_is_per_tab_and_clear_waits_for_the_answer(tiny: ChatApp) -> None:
    """The race tab's Stop leaves the chat alone; Clear stops the chat and returns only after
    its last update, so that update cannot bring the old conversation back."""
    chat = tiny.chat("def add", [], settings(method="none", max_new_tokens=200), session="s")
    next(chat), next(chat)
    race = tiny.race("hello", settings(), session="s")
    next(race)  # waits for the chat
    assert "Stopping" in tiny.stop("s", "race")
    assert "Stopped while waiting" in final(list(race), RACE_OUTPUTS)["notice"]
    order: list[str] = []
    cleared: list[tuple] = []

    def clear() -> None:
        cleared.append(tiny.clear("s"))
        order.append("cleared")

    clearing = threading.Thread(target=clear)
    clearing.start()
    clearing.join(0.3)
    assert clearing.is_alive()  # waits for the running answer ...
    rest = []
    for update in chat:
        rest.append(update)
        order.append("update")
    clearing.join(10)
    assert order[-1] == "cleared" and order.count("update") >= 1  # ... which ended first
    assert "Stopped" in final(rest)["notice"]
    assert dict(zip(CHAT_OUTPUTS, cleared[0], strict=True))["history"] == []
    assert "Nothing to stop" in tiny.stop("s")


def test_preset_switch_while_generating(tiny: ChatApp, tiny_presets: dict[str, str]) -> None:
    """The switch waits for the running answer, which ends complete and unchanged."""
    pipe = tiny.host.pipeline
    ids = pipe.encode_chat([{"role": "user", "content": "def add"}])
    expected = pipe.run(pipe.request(ids, max_new_tokens=12, temperature=0.0), "ngram").text
    stream = tiny.chat("def add", [], settings(max_new_tokens=12, method="ngram"))
    next(stream), next(stream)
    switched: list[dict[str, object]] = []
    switch = threading.Thread(target=lambda: switched.append(final(list(
        tiny.switch_preset(tiny_presets["plain"])), SWITCH_OUTPUTS)))
    switch.start()
    out = final(list(stream))
    switch.join(60)
    assert not switch.is_alive() and "tiny none" in switched[0]["status"]
    assert out["history"][-1] == {"role": "assistant", "content": expected}
    assert tiny.host.status().active == tiny_presets["plain"]
    assert "tiny none" in tiny.status()


def test_race_refusals(tiny: ChatApp) -> None:
    out = final(list(tiny.race("def add", settings())), RACE_OUTPUTS)
    assert "identical: <b>yes</b>" in out["race"]  # greedy: the n-gram run matches plain
    refused = final(list(tiny.race("def add", settings(seed=-1))), RACE_OUTPUTS)
    assert "seed" in refused["notice"] and "⚠" in refused["notice"]
    assert "Type a prompt" in final(list(tiny.race(" ", settings())), RACE_OUTPUTS)["notice"]


def test_race_failure_mid_run_says_so(tiny: ChatApp, expects_bug: None) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 2, RuntimeError("boom"))
    try:
        out = final(list(tiny.race("def add", settings())), RACE_OUTPUTS)
    finally:
        del pipe.stream
    assert "The generation failed" in out["notice"] and "identical" not in out["race"]
    assert not tiny.host.generation_lock.locked()


def test_controls_come_from_the_config(tiny: ChatApp) -> None:
    """The sliders' ranges are the config's limits; the adapter builds one Settings."""
    assert setting_range("temperature", 0.05) == (0.0, SLIDER_MAX["temperature"])
    assert SLIDER_MAX["temperature"] < MAX_TEMPERATURE
    assert setting_range("top_k", 1) == (0, SLIDER_MAX["top_k"]) and SLIDER_MAX["top_k"] < MAX_TOP_K
    assert setting_range("max_new_tokens", 1) == (1, SLIDER_MAX["max_new_tokens"])
    assert SLIDER_MAX["max_new_tokens"] <= MAX_NEW_TOKENS
    assert setting_range("num_speculative_tokens", 1) == (1, MAX_SPECULATIVE_TOKENS)
    assert setting_range("top_p", 0.05) == (0.05, 1.0)
    demo = build(tiny)
    sliders = {c.elem_id: c for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    for control, (setting, step, _) in SLIDERS.items():
        slider = sliders[f"ls-{control}"]
        assert (slider.minimum, slider.maximum) == setting_range(setting, step)
    seed = next(c for c in demo.blocks.values() if c.elem_id == "ls-seed")
    assert seed.precision is None  # Gradio's int(round(nan)) would be a traceback
    message = next(c for c in demo.blocks.values() if c.elem_id == "ls-message")
    assert message.lines == 1 and message.max_lines > 1  # Enter sends in Gradio 6.31


# ----------------------------------------------------------------------------- SmolLM2


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
    outputs = list(smol.chat(COPY_PROMPT, [], settings()))
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
    first = final(list(smol.chat("What is 2 + 2? Answer with one number.", [], terse)))
    history = first["history"]
    second = final(list(smol.chat("And 3 + 3?", history, terse)))
    assert [m["role"] for m in second["history"]] == ["user", "assistant"] * 2
    assert second["history"][:2] == history
    again = final(list(smol.regenerate(second["history"], terse)))
    assert again["history"] == second["history"]  # greedy: the same answer again
    assert "Nothing to regenerate yet." in final(list(smol.regenerate([], settings())))["notice"]


@pytest.mark.real_model
def test_empty_message_is_refused_politely(smol: ChatApp) -> None:
    outputs = list(smol.chat("   ", HISTORY, settings()))
    assert len(outputs) == 1
    out = final(outputs)
    assert is_skip(out["history"]) and "empty message" in out["notice"]


@pytest.mark.real_model
def test_prompt_over_the_context_is_an_error_and_the_text_comes_back(smol: ChatApp) -> None:
    long = "word " * 9000  # SmolLM2 holds 8192 tokens
    out = final(list(smol.chat(long, HISTORY, settings())))
    assert "context" in out["notice"] and "⚠" in out["notice"]
    assert out["history"] == HISTORY and out["message"] == long  # nothing lost


@pytest.mark.real_model
def test_draft_method_without_a_draft_model_says_why(smol: ChatApp) -> None:
    out = final(list(smol.chat("hello", [], settings(method="draft_model"))))
    assert "needs a draft model" in out["notice"]
    assert out["history"] == [] and out["message"] == "hello"


@pytest.mark.real_model
def test_stop_cancels_within_a_step(smol: ChatApp) -> None:
    stream = smol.chat("Write a long story about a dragon.", [],
                       settings(max_new_tokens=400, method="none"))
    streamed = [next(stream) for _ in range(4)]  # user message, then three steps
    assert "Stopping after the current step" in smol.stop()
    rest = list(stream)
    assert len(rest) <= 2  # at most the step under way, then the final update
    out = final(streamed + rest)
    assert "Stopped." in out["notice"]
    assert "stopped: cancelled" in out["summary"]
    assert len(out["spans"]) < 20 and out["history"][-1]["content"]
    assert "Nothing to stop." in smol.stop()
    assert not smol.host.generation_lock.locked()


@pytest.mark.real_model
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
    answer = final(list(smol.chat(COPY_PROMPT, [], settings(max_new_tokens=8))))
    assert answer["history"][-1]["content"]


@pytest.mark.real_model
def test_foreign_tokenizer_draft_is_refused(smol: ChatApp, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.toml"
    foreign.write_text('name = "f"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                       'model = "smollm2-135m-instruct"\ndtype = "bfloat16"\n'
                       '[speculative_config]\nmethod = "draft_model"\n'
                       'model = "qwen2.5-coder-0.5b-instruct"\n', encoding="utf-8")
    out = final(list(smol.switch_preset(str(foreign))), SWITCH_OUTPUTS)
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
    out = final(list(smol.switch_preset(str(plain))), SWITCH_OUTPUTS)
    assert "SmolLM2 plain" in out["status"] and "ls-error" not in out["status"]
    assert smol.host.pipeline.target is target  # only the method changed: no reload
    assert out["temperature"] == 0.5 and out["max_new_tokens"] == 77
    reply = final(list(smol.chat("Say hi again.", HISTORY, settings(max_new_tokens=8))))
    assert reply["history"][:2] == HISTORY and "none" in reply["summary"]


@pytest.mark.real_model
def test_race_mode(smol: ChatApp) -> None:
    out = final(list(smol.race(COPY_PROMPT, settings())), RACE_OUTPUTS)
    assert "identical: <b>yes</b>" in out["race"] and "speedup" in out["race"]
    assert "plain decoding (none)" in out["race"] and "speculative (ngram)" in out["race"]
    refused = final(list(smol.race(COPY_PROMPT, settings(method="none"))), RACE_OUTPUTS)
    assert "Pick a speculative method" in refused["notice"]


def test_no_model_loaded_says_so_and_keeps_the_message() -> None:
    """A start with a preset that cannot load: the page works and says what to do."""
    host = ModelHost()
    assert not host.load("no-such-preset")
    app = ChatApp(host, detect_hardware(), "no-such-preset")
    assert isinstance(build(app), gr.Blocks)
    assert "No model loaded" in app.status() and "unknown preset" in app.status()
    out = final(list(app.chat("hello", [], settings())))
    assert "No model is loaded" in out["notice"] and "unknown preset" in out["notice"]
    assert out["history"] == [] and out["message"] == "hello"


def test_background_cache_audit_reports_damage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached model that fails the full check after loading is named in the status line;
    one that passes leaves the status clean."""
    import localspec.ui.host as host_module

    target, draft = (type("Loaded", (), {"name": n})() for n in ("the-target", "the-draft"))
    preset = type("Preset", (), {"name": "tiny"})()
    pipeline = type("Pipe", (), {"target": target, "draft": draft, "preset": preset})()
    found = {"the-target": None, "the-draft": "model.safetensors: SHA-256 differs"}
    monkeypatch.setattr(host_module, "audit_cache", lambda loaded: found[loaded.name])
    host = ModelHost()
    host._pipeline = pipeline
    host._audit_cache(pipeline)
    error = host.status().error
    assert error is not None and "the-draft" in error and "SHA-256 differs" in error
    assert "the-target" not in error
