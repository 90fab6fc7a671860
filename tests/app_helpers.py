"""What the app's test modules share: the controls' values as one ``Settings``, a handler's last
update by output name (``ended``: with the saved conversation's id it gave), Gradio's "leave
it alone" value, a conversation to continue, and a pipeline's ``stream`` swapped for one that
fails after some events or says a given text (the browser tests use that one too). Their shared
fixtures (the tiny presets and app, the check that nothing is logged at ERROR) are in conftest:
pytest shares a fixture across modules only from there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import gradio as gr

from localspec.engine.engine import StepEvent
from localspec.pipeline import Pipeline
from localspec.ui.app import CHAT_OUTPUTS, Settings

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]


def settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                 "max_new_tokens": 48, "k": 8, "seed": 0}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def final(outputs: list[tuple], names: tuple[str, ...] = CHAT_OUTPUTS) -> dict[str, object]:
    return dict(zip(names, outputs[-1], strict=True))


def is_skip(value: object) -> bool:
    return value == gr.skip()


def ended(outputs: Iterable[tuple]) -> dict[str, object]:
    """A handler's last update by output name, with the conversation id it last gave the tab
    (a later update leaves it as it is: ``gr.skip()``)."""
    outputs = list(outputs)
    out = final(outputs)
    given = [o[CHAT_OUTPUTS.index("conversation")] for o in outputs]
    out["conversation"] = [c for c in given if not is_skip(c)][-1]
    return out


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
