"""The app's "Tune for this machine": ``localspec tune`` over the preset the app has loaded.

It runs ``training.tuning`` on the host's engine thread (where every generation runs), holding
the generation lock as an answer does, so a chat waits for it and it waits for a chat. Its
progress lines show as they come; at the end its tables, and the preset dropdown lists the
tuned preset (``<preset>-tuned``); "Stop tuning" ends it before its next run, saving nothing.
The built-in prompts, ``TUNE_TOKENS`` new tokens each and two before/after rounds: about two
minutes for the default preset on 2 cores.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout

import gradio as gr

from localspec.errors import LocalSpecError
from localspec.host import ModelHost
from localspec.training.prompts import encode_prompts, load_prompts
from localspec.training.tuning import check_name, format_report, run_tune, tuned_name
from localspec.ui.chat_view import notice_html
from localspec.ui.preset_handlers import PresetHandlers
from localspec.ui.turns import Turns

TUNE_TOKENS = 64
TUNE_REPEATS = 2
POLL_S = 0.5

Update = tuple[str, dict]


def _lines_html(lines: list[str]) -> str:
    return f'<pre class="ls-tune">{html.escape(chr(10).join(lines))}</pre>'


def tune_here(turns: Turns, presets: PresetHandlers, session: str) -> Iterator[Update]:
    """Tune the loaded preset, taking a turn at the model from ``turns``: (progress or result
    HTML, the dropdown's update, whose choices come from ``presets``) as it goes."""
    host = turns.host
    cancel = host.begin(f"{session}/tune")
    try:
        why_not = yield from turns.wait_turn(cancel, lambda text: (notice_html(text), gr.update()))
        if why_not is not None:
            yield notice_html(why_not), gr.update()
            return
        try:  # the preset read with the turn held: a switch cannot come between
            key = host.status().active
            if key is None:
                yield notice_html("No preset is loaded."), gr.update()
                return
            yield from _tune(host, presets, key, cancel.is_set)
        finally:
            host.generation_lock.release()
    finally:
        host.end(f"{session}/tune", cancel)


def _tune(host: ModelHost, presets: PresetHandlers, key: str,
          cancelled: Callable[[], bool]) -> Iterator[Update]:
    pipe = host.pipeline
    lines = [f"Tuning {key} on this machine (a few minutes; answers wait meanwhile)…"]
    yield _lines_html(lines), gr.update()
    try:
        check_name(tuned_name(key))
    except LocalSpecError as exc:
        yield notice_html(f"⚠ {exc}"), gr.update()
        return

    def work() -> dict:
        encoded = encode_prompts(pipe, load_prompts(None), TUNE_TOKENS)
        return run_tune(pipe, key, encoded, TUNE_TOKENS, TUNE_REPEATS, log=lines.append,
                        cancelled=cancelled)

    future = host.submit_on_engine(work)
    while True:
        try:
            report = future.result(timeout=POLL_S)
            break
        except FutureTimeout:
            yield _lines_html(lines), gr.update()
        except LocalSpecError as exc:
            yield notice_html(f"⚠ {exc}"), gr.update()
            return
    yield (_lines_html(format_report(report).splitlines()),
           gr.update(choices=presets.choices()))
