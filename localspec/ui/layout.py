"""The page: a ``gr.Blocks`` laid out over a ``ChatApp``'s handlers (chat, race, presets).

Layout only: which component goes where, and which event calls which handler. The controls'
ranges and starting values come from ``localspec.config``'s request schema (the single source of
the limits the pipeline enforces), and the method switch's choices from the drafter registry,
never from literals here. Each event takes its inputs as a
set, so Gradio hands the handler one dict (component -> value) instead of a row of positional
values; ``Controls.settings`` turns the side panel's part of it into the one ``Settings``, so no
handler takes nine loose parameters.

The controls do not clamp or cast: a value the pipeline refuses (NaN, a seed beyond 64 bits)
reaches ``Pipeline.request``, whose message the user reads under the chat.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import annotated_types
import gradio as gr

from localspec.config import RequestSettings
from localspec.registry import drafters
from localspec.ui.chat_handlers import ChatHandlers
from localspec.ui.chat_view import (
    CHAT_JS,
    MARKDOWN_MINE_ATTRIBUTE,
    RAW_ATTRIBUTE,
    chat_html,
    toggle_js,
)
from localspec.ui.chats_panel import build_panel, wire_panel
from localspec.ui.conversations import Conversations
from localspec.ui.handlers import ChatApp
from localspec.ui.models_view import build_models_tab, wire_models
from localspec.ui.preset_handlers import PresetHandlers
from localspec.ui.race import RaceHandlers
from localspec.ui.render import legend_html, spans_html
from localspec.ui.tuning_view import tune_here
from localspec.ui.turns import Turns
from localspec.ui.views import ChatView, RaceView, Settings, SwitchView, session_of

# The span of the sliders: the useful range, inside the limits the config's schema sets.
SLIDER_MAX = {"temperature": 2.0, "top_k": 200, "max_new_tokens": 8192}
SLIDERS = {  # control -> (request setting, step, label)
    "temperature": ("temperature", 0.05, "temperature (0 = greedy)"),
    "top_p": ("top_p", 0.05, "top-p"),
    "top_k": ("top_k", 1, "top-k (0 = off)"),
    "max_new_tokens": ("max_new_tokens", 1, "max new tokens"),
    "k": ("num_speculative_tokens", 1, "k: most draft tokens per step"),
}


def method_choices() -> list[tuple[str, str]]:
    """The method switch's (label, value) pairs: the preset's own method, then every
    registered one under its label."""
    return [("preset's method", "preset"), *((spec.label, spec.name) for spec in drafters())]


def setting_range(name: str, step: float) -> tuple[float, float]:
    """(lowest, highest) value of request setting ``name`` that the config's schema accepts,
    capped at ``SLIDER_MAX`` (temperature 100 is valid but no use on a slider); an
    open lower bound (top-p > 0) starts one ``step`` above it."""
    low, high = 0.0, float("inf")
    for bound in RequestSettings.model_fields[name].metadata:
        if isinstance(bound, annotated_types.Ge):
            low = bound.ge
        elif isinstance(bound, annotated_types.Gt):
            low = bound.gt + step
        elif isinstance(bound, annotated_types.Le):
            high = bound.le
    return low, min(high, SLIDER_MAX.get(name, high))


@dataclass
class Controls:
    """The side panel's components; the one adapter from their values to a ``Settings``."""

    system: gr.Textbox
    method: gr.Radio
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Slider
    max_new_tokens: gr.Slider
    k: gr.Slider
    seed: gr.Number
    show_rejected: gr.Checkbox

    def components(self) -> dict[str, gr.components.Component]:
        return {name: getattr(self, name) for name in Settings.__dataclass_fields__}

    def settings(self, values: dict[Any, Any]) -> Settings:
        """``values``: what Gradio passes for a set of inputs (component -> value)."""
        return Settings(**{name: values[c] for name, c in self.components().items()})


def _controls() -> Controls:
    """The side panel's controls, ranged and set from the config's request schema."""
    defaults = RequestSettings()
    with gr.Accordion("Method and sampling", open=True):
        method = gr.Radio(method_choices(), value="preset", label="Method", elem_id="ls-method")
        sliders = {}
        for control, (setting, step, label) in SLIDERS.items():
            low, high = setting_range(setting, step)
            sliders[control] = gr.Slider(low, high, value=getattr(defaults, setting), step=step,
                                         label=label, elem_id=f"ls-{control}")
        # precision=None: the value is handed on as typed, for the pipeline to judge (Gradio's
        # own rounding would turn NaN into a traceback).
        seed = gr.Number(defaults.seed, precision=None, label="seed", elem_id="ls-seed")
        show_rejected = gr.Checkbox(True, label="show rejected drafts")
    system = gr.Textbox("", label="System prompt", lines=2, elem_id="ls-system")
    return Controls(system=system, method=method, seed=seed, show_rejected=show_rejected,
                    **sliders)


@dataclass
class ChatTab:
    """The chat column's components (and the readout beside it), for wiring."""

    history: gr.State
    chat: gr.HTML
    message: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    clear: gr.Button
    notice: gr.HTML
    tokens: gr.HTML
    summary: gr.HTML
    spans: gr.State
    conversation: gr.State  # the saved conversation's id (None: not saved yet)
    stats: gr.HTML | None = None

    def outputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in ChatView._fields]


def _chat_column() -> ChatTab:
    chat = gr.HTML(chat_html([]), elem_id="ls-chat", js_on_load=CHAT_JS)
    with gr.Row():
        # lines=1 with max_lines > 1: Gradio 6.31 sends on Enter only when lines == 1 (with
        # lines > 1 it sends on Shift+Enter instead); the box still grows to max_lines, and
        # Shift+Enter starts a new line.
        message = gr.Textbox(placeholder="Ask something… (Enter sends, Shift+Enter: new line)",
                             show_label=False, scale=5, lines=1, max_lines=12,
                             elem_id="ls-message")
        send = gr.Button("Send", variant="primary", scale=1, elem_id="ls-send")
    with gr.Row():
        stop = gr.Button("Stop", variant="stop", elem_id="ls-stop")
        regenerate = gr.Button("Regenerate", elem_id="ls-regenerate")
        clear = gr.Button("Clear", elem_id="ls-clear")
    _view_toggles()
    notice = gr.HTML("", elem_id="ls-notice", js_on_load=None)
    gr.Markdown("**The last answer, token by token** (hover a token: step, p under the "
                "target, q under the drafter)")
    gr.HTML(legend_html(), js_on_load=None)
    tokens = gr.HTML(spans_html([]), elem_id="ls-tokens", js_on_load=None)
    summary = gr.HTML("", elem_id="ls-summary", js_on_load=None)
    return ChatTab(gr.State([]), chat, message, send, stop, regenerate, clear, notice, tokens,
                   summary, gr.State([]), gr.State(None))


def _view_toggles() -> None:
    """How the chat shows messages: switched in the browser (``chat_view.toggle_js`` sets an
    attribute the chat's CSS reads), so a switch is instant, holds while an answer streams and
    needs no handler."""
    with gr.Row():
        for label, attribute, elem_id in (
                ("show raw text", RAW_ATTRIBUTE, "ls-raw"),
                ("render my messages as Markdown", MARKDOWN_MINE_ATTRIBUTE, "ls-md-mine")):
            box = gr.Checkbox(False, label=label, elem_id=elem_id, container=False)
            box.change(None, box, None, js=toggle_js(attribute), queue=False,
                       show_progress="hidden")


@dataclass
class PresetPanel:
    """The preset picker, the path box and the active preset's description."""

    preset: gr.Dropdown
    path: gr.Textbox
    load: gr.Button
    info: gr.HTML
    tune: gr.Button
    stop_tune: gr.Button
    tuned: gr.HTML


def _preset_panel(presets: PresetHandlers) -> PresetPanel:
    with gr.Accordion("Preset", open=True):
        choices = presets.choices()
        listed = {value for _, value in choices}
        preset = gr.Dropdown(choices, label="Preset", elem_id="ls-preset",
                             value=presets.default_preset if presets.default_preset in listed
                             else None)
        with gr.Row():
            path = gr.Textbox(label="…or a preset file path", scale=4, elem_id="ls-preset-path")
            load = gr.Button("Load", scale=1, elem_id="ls-load-path")
        info = gr.HTML("", elem_id="ls-preset-info", js_on_load=None)
        with gr.Row():
            tune = gr.Button("Tune for this machine", size="sm", elem_id="ls-tune")
            stop_tune = gr.Button("Stop tuning", size="sm", elem_id="ls-tune-stop")
        tuned = gr.HTML("", elem_id="ls-tune-out", js_on_load=None)
        with gr.Accordion("All presets and what fits", open=False):
            gr.HTML(presets.table_html(), js_on_load=None)
    return PresetPanel(preset, path, load, info, tune, stop_tune, tuned)


def build(app: ChatApp, api_info: str = "", conversations: Conversations | None = None
          ) -> gr.Blocks:
    """The page (``api_info``: where its API is, shown under the status; ``conversations``:
    the saved conversations' panel, by default over ``app.chat``'s store). Launch it with
    ``css=APP_CSS`` (``localspec.ui.app``)."""
    conversations = conversations or Conversations(app.chat)
    with gr.Blocks(title="LocalSpec", analytics_enabled=False) as demo:
        gr.Markdown("# LocalSpec: speculative decoding you can watch\n"
                    "Green tokens were guessed by the drafter and accepted by the target; "
                    "the output is exactly what the target alone would say.")
        status = gr.HTML(app.presets.status(), elem_id="ls-status", js_on_load=None)
        if api_info:
            gr.HTML(api_info, elem_id="ls-api", js_on_load=None)
        with gr.Tabs():
            with gr.Tab("Chat"), gr.Row():
                with gr.Column(scale=1, min_width=220):
                    chats = build_panel()
                with gr.Column(scale=3):
                    tab = _chat_column()
                with gr.Column(scale=2):
                    tab.stats = gr.HTML("", elem_id="ls-stats", js_on_load=None)
                    panel = _preset_panel(app.presets)
                    controls = _controls()
            with gr.Tab("Race"):
                gr.Markdown("The same prompt through plain decoding and through the chosen "
                            "speculative method, one after the other on this machine.")
                race_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="ls-race-prompt")
                with gr.Row():
                    race_go = gr.Button("Race", variant="primary", elem_id="ls-race-go")
                    race_stop = gr.Button("Stop", variant="stop", elem_id="ls-race-stop")
                race_notice = gr.HTML("", elem_id="ls-race-notice", js_on_load=None)
                race_out = gr.HTML("", elem_id="ls-race", js_on_load=None)
            with gr.Tab("Models"):
                models = build_models_tab()
        switch_outputs = [status, panel.preset, panel.info, controls.method,
                          *(getattr(controls, name) for name in SwitchView._fields[4:])]
        answers = _wire_chat(app.chat, app.turns, tab, controls)
        wire_panel(conversations, chats, tab.conversation, tab.outputs(), answers)
        _wire_race(app.race, app.turns, race_prompt, race_go, race_stop,
                   [race_out, race_notice], controls)
        for trigger, source in ((panel.preset.input, panel.preset),
                                (panel.load.click, panel.path)):
            trigger(app.presets.switch, source, switch_outputs, concurrency_limit=1,
                    concurrency_id="switch", show_progress="hidden")
        def tune(request: gr.Request) -> Iterator[tuple[str, dict]]:
            yield from tune_here(app.turns, app.presets, session_of(request))

        panel.tune.click(tune, None, [panel.tuned, panel.preset], concurrency_limit=1,
                         concurrency_id="tune", show_progress="hidden")
        def stop_tune(request: gr.Request) -> str | dict:
            return app.turns.stop(session_of(request), "tune")

        panel.stop_tune.click(stop_tune, None, panel.tuned, queue=False)
        gr.Timer(1.0).tick(app.presets.status, None, status, show_progress="hidden", queue=False)
        wire_models(models, panel.preset, app.presets.choices, demo)
        demo.load(app.presets.initial_controls, None, switch_outputs, queue=False)
        demo.load(conversations.page, None, chats.outputs(), queue=False)
    return demo


def _wire_chat(chat: ChatHandlers, turns: Turns, tab: ChatTab, controls: Controls) -> list[Any]:
    """The chat's events; returns those that generate an answer."""
    inputs = {tab.message, tab.history, tab.conversation, *controls.components().values()}

    def send(values: dict[Any, Any], request: gr.Request) -> Iterator[ChatView]:
        yield from chat.send(values[tab.message], values[tab.history],
                             controls.settings(values), session_of(request),
                             values[tab.conversation])

    def regenerate(values: dict[Any, Any], request: gr.Request) -> Iterator[ChatView]:
        yield from chat.regenerate(values[tab.history], controls.settings(values),
                                   session_of(request), values[tab.conversation])

    def stop(request: gr.Request) -> str:
        return turns.stop(session_of(request), "chat")

    def clear(request: gr.Request) -> ChatView:
        return chat.clear(session_of(request))

    answers = [trigger(send, inputs, tab.outputs(), concurrency_limit=None,
                       show_progress="hidden") for trigger in (tab.send.click, tab.message.submit)]
    answers.append(tab.regenerate.click(regenerate, inputs, tab.outputs(), concurrency_limit=None,
                                        show_progress="hidden"))
    tab.stop.click(stop, None, tab.notice, queue=False)
    tab.clear.click(clear, None, tab.outputs(), queue=False)
    controls.show_rejected.change(chat.rerender, [tab.spans, controls.show_rejected],
                                  tab.tokens, queue=False)
    return answers


def _wire_race(race: RaceHandlers, turns: Turns, prompt: gr.Textbox, go: gr.Button,
               stop_button: gr.Button, outputs: list[gr.components.Component],
               controls: Controls) -> None:
    inputs = {prompt, *controls.components().values()}

    def race(values: dict[Any, Any], request: gr.Request) -> Iterator[RaceView]:
        yield from race.run(values[prompt], controls.settings(values), session_of(request))

    def stop(request: gr.Request) -> str:
        return turns.stop(session_of(request), "race")

    go.click(race, inputs, outputs, concurrency_limit=None, show_progress="hidden")
    stop_button.click(stop, None, outputs[1], queue=False)
