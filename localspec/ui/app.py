"""The Gradio app: chat with colour-coded speculation, a live readout, presets and race mode.

``ChatApp`` holds the handlers (plain generators: tests call them directly, without a browser)
and ``build`` lays them out in a ``gr.Blocks``. Everything it shows comes from the pure functions
in ``localspec.ui.render``; the models come from a ``ModelHost``, which it is given. It never
touches tensors.

Concurrency: Gradio may run several sessions' handlers at once; the host's generation lock lets
one generate, and the others say that they are waiting (and can be stopped while they wait).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr

from localspec.models.hardware import Hardware, PresetSummary, survey_presets
from localspec.pipeline import Pipeline
from localspec.config import METHODS, Preset
from localspec.ui.host import ModelHost
from localspec.ui.render import (
    CSS,
    LiveStats,
    RaceSide,
    TokenSpan,
    TokenTexts,
    event_spans,
    legend_html,
    race_html,
    spans_html,
    stats_html,
    status_html,
    summary_line,
)

logger = logging.getLogger(__name__)

METHOD_CHOICES = [("preset's method", "preset"), ("none (plain decoding)", "none"),
                  ("draft model", "draft_model"), ("n-gram lookup", "ngram")]
CHAT_OUTPUTS = ("history", "message", "tokens", "stats", "summary", "notice", "spans")
SWITCH_OUTPUTS = ("status", "preset", "info", "method", "temperature", "top_p", "top_k",
                  "max_new_tokens", "k", "seed")
RACE_OUTPUTS = ("race", "notice")
EXTRA_CSS = """
.ls-error { color: #b91c1c; font-weight: 600; }
.ls-loading progress { vertical-align: middle; width: 160px; }
#ls-notice { min-height: 1.5em; }
"""


@dataclass(frozen=True)
class Settings:
    """What the side panel says about the next generation."""

    system: str = ""
    method: str = "preset"  # "preset" or one of METHODS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    k: int = 5
    seed: int = 0
    show_rejected: bool = True


def text_of(content: Any) -> str:
    """Message content as plain text (Gradio 6 hands content over as a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list | tuple):
        return "".join(text_of(part) for part in content)
    return "" if content is None else str(content)


def plain_history(history: Sequence[dict] | None) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": text_of(m.get("content"))} for m in history or []]


def session_of(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


def _skip() -> Any:
    return gr.skip()


class ChatApp:
    """Handlers of the app, over a ModelHost and a description of this machine."""

    def __init__(self, host: ModelHost, hardware: Hardware, default_preset: str,
                 min_update_interval: float = 0.08,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.host = host
        self.hardware = hardware
        self.default_preset = default_preset
        self.min_update_interval = min_update_interval
        self.clock = clock

    # ------------------------------------------------------------------ status

    def status(self) -> str:
        st = self.host.status()
        return status_html(st.active_title, st.active, st.loading, st.message, st.fraction,
                           st.error)

    def preset_rows(self) -> list[PresetSummary]:
        return survey_presets(self.hardware)

    def preset_choices(self) -> list[tuple[str, str]]:
        choices = []
        for row in self.preset_rows():
            label = row.title if row.fits else f"{row.title} — ✗ {row.reason}"
            choices.append((label, row.key))
        return choices

    def presets_markdown(self) -> str:
        lines = [f"**This machine:** {self.hardware.describe()}", ""]
        group = None
        for row in self.preset_rows():
            if row.hardware != group:
                group = row.hardware
                lines.append(f"**{group}**")
            mark = "✓" if row.fits else "✗"
            detail = row.error or row.reason
            lines.append(f"- {mark} `{row.key}`: {detail}")
        return "\n".join(lines)

    @staticmethod
    def preset_info(preset: Preset | None) -> str:
        if preset is None:
            return ""
        sc = preset.speculative_config
        draft = f" + draft `{sc.model}`" if sc.model else ""
        return (f"**{preset.name}**: {preset.description}  \ntarget `{preset.target.model}` "
                f"({preset.target.quantization}){draft}, method `{sc.method}`, k ≤ "
                f"{sc.num_speculative_tokens}")

    # ------------------------------------------------------------------ waiting for a turn

    def _wait_turn(self, cancel: Any, notice: Callable[[str], tuple]) -> Iterator[tuple]:
        """Wait for loaded models and the generation lock, yielding notices; returns whether the
        lock is held (False: stopped while waiting, or no model)."""
        while self.host.is_loading():
            if cancel.is_set():
                yield notice("Stopped while waiting for the models to load.")
                return False
            st = self.host.status()
            yield notice(f"⏳ Waiting for the models to load: {st.message} ({st.fraction:.0%})")
            self.host.wait_loaded(0.5)
        if self.host.pipeline is None:
            st = self.host.status()
            yield notice(f"⚠ No model is loaded{': ' + st.error if st.error else ''}. "
                         "Pick a preset that fits this machine.")
            return False
        got = self.host.acquire(cancel, 0.0)
        if got:
            return True
        waiting = self.host.set_waiting(+1)
        try:
            while not got:
                if got is None:
                    yield notice("Stopped while waiting for your turn.")
                    return False
                yield notice(f"⏳ Waiting: another tab is generating ({waiting} waiting). "
                             "Yours starts as soon as it finishes.")
                got = self.host.acquire(cancel, 0.5)
        finally:
            self.host.set_waiting(-1)
        return True

    # ------------------------------------------------------------------ chat

    def chat(self, message: str, history: list[dict] | None, system: str, method: str,
                 temperature: float, top_p: float, top_k: int, max_new_tokens: int, k: int,
                 seed: int, show_rejected: bool,
                 request: gr.Request | None = None) -> Iterator[tuple]:
        """Send ``message``; stream (history, message box, tokens, stats, summary, notice,
        spans) as tokens arrive."""
        s = Settings(system, method, temperature, top_p, top_k, max_new_tokens, k, seed,
                     show_rejected)
        history = plain_history(history)
        text = (message or "").strip()
        if not text:
            yield (history, "", _skip(), _skip(), _skip(),
                   "Type a message first: an empty message has nothing to answer.", _skip())
            return
        yield from self._answer([*history, {"role": "user", "content": text}], s,
                                session_of(request), restore=message)

    def regenerate(self, history: list[dict] | None, system: str, method: str,
                 temperature: float, top_p: float, top_k: int, max_new_tokens: int, k: int,
                 seed: int, show_rejected: bool,
                 request: gr.Request | None = None) -> Iterator[tuple]:
        """Answer the last user message again."""
        history = plain_history(history)
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            yield (history, _skip(), _skip(), _skip(), _skip(), "Nothing to regenerate yet.",
                   _skip())
            return
        s = Settings(system, method, temperature, top_p, top_k, max_new_tokens, k, seed,
                     show_rejected)
        yield from self._answer(history, s, session_of(request), restore="")

    def stop(self, request: gr.Request | None = None) -> str:
        if self.host.cancel(session_of(request)):
            return "Stopping after the current step…"
        return "Nothing to stop."

    @staticmethod
    def clear() -> tuple:
        return ([], "", spans_html([]), "", "", "", [])

    @staticmethod
    def rerender(spans: list[TokenSpan] | None, show_rejected: bool) -> str:
        return spans_html(spans or [], show_rejected)

    def _answer(self, history: list[dict[str, str]], s: Settings, session: str,
                restore: str) -> Iterator[tuple]:
        def notice(text: str) -> tuple:
            return (history, "", _skip(), _skip(), _skip(), text, _skip())

        cancel = self.host.begin(session)
        try:
            yield (history, "", spans_html([]), _skip(), "", "", [])  # a new answer begins
            held = yield from self._wait_turn(cancel, notice)
            if not held:  # the notice stays; the message goes back into the box
                yield (history[:-1] if restore else history, restore, *(_skip(),) * 5)
                return
            try:
                yield from self._stream_answer(self.host.pipeline, history, s, cancel, restore)
            finally:
                self.host.generation_lock.release()
        finally:
            self.host.end(session, cancel)

    def _method(self, pipe: Pipeline, s: Settings) -> str:
        return pipe.preset.speculative_config.method if s.method == "preset" else s.method

    def _start(self, pipe: Pipeline, messages: list[dict[str, str]], s: Settings, method: str,
               cancel: Any) -> Iterator:
        """Validate and start a generation (errors raise here, before any token)."""
        if method not in METHODS:
            raise ValueError(f"unknown method '{method}'")
        prompt_ids = pipe.encode_chat(messages)
        request = pipe.request(prompt_ids, temperature=float(s.temperature),
                               top_p=float(s.top_p), top_k=int(s.top_k),
                               max_new_tokens=int(s.max_new_tokens),
                               num_speculative_tokens=int(s.k), seed=int(s.seed))
        return pipe.stream(request, method, cancelled=cancel.is_set)

    def _stream_answer(self, pipe: Pipeline, history: list[dict[str, str]], s: Settings,
                       cancel: Any, restore: str) -> Iterator[tuple]:
        method = self._method(pipe, s)
        system = [{"role": "system", "content": s.system}] if s.system.strip() else []
        try:
            events = self._start(pipe, system + history, s, method, cancel)
        except Exception as exc:  # any refusal is shown; the conversation stays
            yield (history[:-1] if restore else history, restore, _skip(), _skip(), _skip(),
                   f"⚠ {exc}", _skip())
            return
        texts = TokenTexts(lambda ids: pipe.tokenizer.decode(ids, skip_special_tokens=True))
        live = LiveStats(method, clock=self.clock)
        spans: list[TokenSpan] = []
        answer = ""
        history = [*history, {"role": "assistant", "content": ""}]
        last = float("-inf")
        error = ""
        try:
            for event in events:
                live.add(event)
                spans.extend(event_spans(event, texts))
                answer += event.text_delta
                history[-1] = {"role": "assistant", "content": answer}
                now = self.clock()
                if event.finish_reason is None and now - last < self.min_update_interval:
                    continue
                last = now
                yield (history, "", spans_html(spans, s.show_rejected), stats_html(live),
                       _skip(), "", spans)
        except Exception as exc:  # a failure mid-answer keeps what was said
            logger.exception("generation failed")
            error = f"⚠ generation failed: {exc}"
        notice = error or ("Stopped." if live.finish_reason == "cancelled" else "")
        yield (history, "", spans_html(spans, s.show_rejected), stats_html(live),
               summary_line(live), notice, spans)

    # ------------------------------------------------------------------ presets

    def switch_preset(self, key: str | None) -> Iterator[tuple]:
        """Load another preset (a name or a .toml path) with progress; keep the old on failure."""
        key = (key or "").strip()
        skips = tuple(_skip() for _ in SWITCH_OUTPUTS[2:])
        if not key:
            yield (self.status(), _skip(), *skips)
            return
        if key == self.host.status().active and self.host.status().error is None:
            yield (self.status(), _skip(), *skips)
            return
        thread = self.host.load_async(key)
        while thread.is_alive():
            yield (self.status(), _skip(), *skips)
            thread.join(0.5)
        st = self.host.status()
        pipe = self.host.pipeline
        if st.active != key or pipe is None:  # failed: the dropdown goes back to the active one
            yield (self.status(), st.active, *skips)
            return
        p = pipe.preset
        listed = {value for _, value in self.preset_choices()}
        yield (self.status(), key if key in listed else None,
               self.preset_info(p), "preset", p.sampling.temperature, p.sampling.top_p,
               p.sampling.top_k, p.sampling.max_new_tokens,
               p.speculative_config.num_speculative_tokens, p.sampling.seed)

    # ------------------------------------------------------------------ race

    def race(self, prompt: str, system: str, method: str,
                 temperature: float, top_p: float, top_k: int, max_new_tokens: int, k: int,
                 seed: int, show_rejected: bool,
                 request: gr.Request | None = None) -> Iterator[tuple]:
        """The same prompt through plain decoding, then through speculation; side by side."""
        s = Settings(system, method, temperature, top_p, top_k, max_new_tokens, k, seed,
                     show_rejected)
        text = (prompt or "").strip()
        if not text:
            yield (_skip(), "Type a prompt to race.")
            return
        session = session_of(request)
        cancel = self.host.begin(session)

        def notice(message: str) -> tuple:
            return (_skip(), message)

        try:
            held = yield from self._wait_turn(cancel, notice)
            if not held:
                return
            try:
                yield from self._race(self.host.pipeline, text, s, cancel)
            finally:
                self.host.generation_lock.release()
        finally:
            self.host.end(session, cancel)

    def _race(self, pipe: Pipeline, prompt: str, s: Settings, cancel: Any) -> Iterator[tuple]:
        method = self._method(pipe, s)
        if method == "none":
            yield (_skip(), "Pick a speculative method (draft model or n-gram) to race against "
                            "plain decoding.")
            return
        system = [{"role": "system", "content": s.system}] if s.system.strip() else []
        messages = [*system, {"role": "user", "content": prompt}]
        sides = [RaceSide("plain decoding (none)", (), None, (), False),
                 RaceSide(f"speculative ({method})", (), None, (), False)]
        greedy = float(s.temperature) == 0.0
        for index, m in enumerate(("none", method)):
            try:
                events = self._start(pipe, messages, s, m, cancel)
            except Exception as exc:  # shown to the user; the race stops there
                yield (race_html(sides[0], sides[1], greedy), f"⚠ {exc}")
                return
            texts = TokenTexts(lambda ids: pipe.tokenizer.decode(ids, skip_special_tokens=True))
            live = LiveStats(m, clock=self.clock)
            spans: list[TokenSpan] = []
            ids: list[int] = []
            last = float("-inf")
            for event in events:
                live.add(event)
                spans.extend(event_spans(event, texts))
                ids.extend(event.tokens)
                sides[index] = RaceSide(sides[index].title, tuple(spans), live, tuple(ids),
                                        event.finish_reason is not None)
                now = self.clock()
                if event.finish_reason is None and now - last < self.min_update_interval:
                    continue
                last = now
                yield (race_html(sides[0], sides[1], greedy), "")
            if live.finish_reason == "cancelled":
                yield (race_html(sides[0], sides[1], greedy), "Stopped.")
                return
        yield (race_html(sides[0], sides[1], greedy), "")

    # ------------------------------------------------------------------ layout

    def build(self) -> gr.Blocks:
        """The page. Launch it with ``css=APP_CSS``."""
        with gr.Blocks(title="LocalSpec", analytics_enabled=False) as demo:
            gr.Markdown("# LocalSpec: speculative decoding you can watch\n"
                        "Green tokens were guessed by the drafter and accepted by the target; "
                        "the output is exactly what the target alone would say.")
            status = gr.HTML(self.status(), elem_id="ls-status")
            with gr.Tabs():
                with gr.Tab("Chat"), gr.Row():
                    with gr.Column(scale=3):
                        chatbot = gr.Chatbot(elem_id="ls-chat", height=360,
                                             buttons=["copy", "copy_all"],
                                             label="Conversation (plain text, copyable)")
                        with gr.Row():
                            message = gr.Textbox(placeholder="Ask something…",
                                                 show_label=False, scale=5, lines=2,
                                                 elem_id="ls-message")
                            send = gr.Button("Send", variant="primary", scale=1,
                                             elem_id="ls-send")
                        with gr.Row():
                            stop = gr.Button("Stop", variant="stop", elem_id="ls-stop")
                            regenerate = gr.Button("Regenerate", elem_id="ls-regenerate")
                            clear = gr.Button("Clear", elem_id="ls-clear")
                        notice = gr.Markdown("", elem_id="ls-notice")
                        gr.Markdown("**The last answer, token by token** (hover a token: "
                                    "step, p under the target, q under the drafter)")
                        gr.HTML(legend_html())
                        tokens = gr.HTML(spans_html([]), elem_id="ls-tokens")
                        summary = gr.Markdown("", elem_id="ls-summary")
                    with gr.Column(scale=2):
                        stats = gr.HTML("", elem_id="ls-stats")
                        with gr.Accordion("Preset", open=True):
                            choices = self.preset_choices()
                            listed = {value for _, value in choices}
                            preset = gr.Dropdown(
                                choices, label="Preset", elem_id="ls-preset",
                                value=self.default_preset
                                if self.default_preset in listed else None)
                            with gr.Row():
                                preset_path = gr.Textbox(label="…or a preset file path",
                                                         scale=4, elem_id="ls-preset-path")
                                load_path = gr.Button("Load", scale=1,
                                                      elem_id="ls-load-path")
                            info = gr.Markdown("")
                            with gr.Accordion("All presets and what fits", open=False):
                                gr.Markdown(self.presets_markdown())
                        with gr.Accordion("Method and sampling", open=True):
                            method = gr.Radio(METHOD_CHOICES, value="preset",
                                              label="Method", elem_id="ls-method")
                            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05,
                                                    label="temperature (0 = greedy)")
                            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                            top_k = gr.Slider(0, 200, value=0, step=1,
                                              label="top-k (0 = off)")
                            max_new = gr.Slider(1, 4096, value=256, step=1,
                                                label="max new tokens")
                            k = gr.Slider(1, 32, value=5, step=1,
                                          label="k: most draft tokens per step")
                            seed = gr.Number(0, precision=0, label="seed")
                            show_rejected = gr.Checkbox(True, label="show rejected drafts")
                        system = gr.Textbox("", label="System prompt", lines=2,
                                            elem_id="ls-system")
                with gr.Tab("Race"):
                    gr.Markdown("The same prompt through plain decoding and through the chosen "
                                "speculative method, one after the other on this machine.")
                    race_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="ls-race-prompt")
                    with gr.Row():
                        race_go = gr.Button("Race", variant="primary", elem_id="ls-race-go")
                        race_stop = gr.Button("Stop", variant="stop")
                    race_notice = gr.Markdown("")
                    race_out = gr.HTML("", elem_id="ls-race")
            spans_state = gr.State([])

            settings = [system, method, temperature, top_p, top_k, max_new, k, seed,
                        show_rejected]
            chat_outputs = [chatbot, message, tokens, stats, summary, notice, spans_state]
            for trigger in (send.click, message.submit):
                trigger(self.chat, [message, chatbot, *settings], chat_outputs,
                        concurrency_limit=None, show_progress="hidden")
            regenerate.click(self.regenerate, [chatbot, *settings], chat_outputs,
                             concurrency_limit=None, show_progress="hidden")
            stop.click(self.stop, None, notice, queue=False)
            race_stop.click(self.stop, None, race_notice, queue=False)
            clear.click(self.clear, None, chat_outputs, queue=False)
            show_rejected.change(self.rerender, [spans_state, show_rejected], tokens,
                                 queue=False)
            switch_outputs = [status, preset, info, method, temperature, top_p, top_k, max_new,
                              k, seed]
            preset.input(self.switch_preset, preset, switch_outputs, concurrency_limit=1,
                         concurrency_id="switch", show_progress="hidden")
            load_path.click(self.switch_preset, preset_path, switch_outputs,
                            concurrency_limit=1, concurrency_id="switch",
                            show_progress="hidden")
            race_go.click(self.race, [race_prompt, *settings], [race_out, race_notice],
                          concurrency_limit=None, show_progress="hidden")
            timer = gr.Timer(1.0)
            timer.tick(self.status, None, status, show_progress="hidden", queue=False)
            demo.load(self._initial_controls, None, [info, temperature, top_p, top_k,
                                                      max_new, k, seed], queue=False)
        return demo

    def _initial_controls(self) -> tuple:
        """Sampling controls from the active (or the default) preset when a page opens."""
        pipe = self.host.pipeline
        p = pipe.preset if pipe is not None else None
        if p is None:
            try:
                from localspec.presets import load_preset

                p = load_preset(self.default_preset)
            except ValueError:
                return tuple(_skip() for _ in range(7))
        return (self.preset_info(p), p.sampling.temperature, p.sampling.top_p, p.sampling.top_k,
                p.sampling.max_new_tokens, p.speculative_config.num_speculative_tokens,
                p.sampling.seed)


APP_CSS = CSS + EXTRA_CSS


def build_app(host: ModelHost, hardware: Hardware, default_preset: str) -> gr.Blocks:
    """The app over ``host`` (which the caller starts loading)."""
    return ChatApp(host, hardware, default_preset).build()
