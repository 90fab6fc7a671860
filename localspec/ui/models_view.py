"""The app's Models tab: the model library, adding a model (a path, or a Hub repo downloaded
with a progress bar), the drafters found for a target and a preset made of one, which the
preset dropdown then lists.

The renderers are pure (library entries and drafter reports in, HTML out; every name and path
is the user's, so it is escaped); the handlers call ``models.library``, ``models.hub`` and
``models.drafter_finder`` and turn their ``LocalSpecError`` into a notice, as the chat does.
A download reports through huggingface_hub's tqdm bar, which ``gr.Progress(track_tqdm=True)``
shows in the page.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from localspec.errors import InputFileError, LocalSpecError
from localspec.models.cache_use import cache_cell
from localspec.models.drafter_finder import DrafterReport, find_drafters, make_preset
from localspec.models.library import LibraryEntry, add_path, entry_cache_use, list_library

Choices = Callable[[], list[tuple[str, str]]]


def _size(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def library_html(entries: list[LibraryEntry], cache: list[str] | None = None) -> str:
    """The library as a table: name, source, architecture, size, quantization, context, what
    the cache holds for it (``cache``, one cell per entry, as ``models list`` writes it) and
    what serves it on the CPU (or why the entry cannot be read)."""
    rows = []
    for i, e in enumerate(entries):
        f = e.facts
        path = e.error or e.note or ("native" if f and f.native else
                                     f"not native: {f.native_reason}" if f else "")
        cells = (e.name, e.source, f.architecture if f else "?", _size(e.size),
                 (f.quantization or "?") if f else "?",
                 str(f.context_length or "?") if f else "?",
                 cache[i] if cache else "?", path or "")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("name", "source", "arch", "size", "quantization",
                                             "context", "cache", "CPU path"))
    return f'<table class="ls-models"><tr>{head}</tr>{"".join(rows)}</table>'


def drafters_html(report: DrafterReport) -> str:
    """The drafters offered for the target, each with its memory, then what was left out."""
    items = "".join(f"<li>{'✓' if c.fits else '✗'} <code>{html.escape(c.key)}</code> "
                    f"({html.escape(c.method)}): {html.escape(c.reason)}</li>"
                    for c in report.choices)
    left = "".join(f"<li><code>{html.escape(name)}</code>: {html.escape(why)}</li>"
                   for name, why in report.refused)
    out = (f"<p>Drafters for <code>{html.escape(report.target.name)}</code> (served as "
           f"{html.escape(report.quantization)}):</p><ul>{items}</ul>")
    return out + (f"<p>Not offered:</p><ul>{left}</ul>" if left else "")


def _targets(entries: list[LibraryEntry]) -> list[str]:
    return [e.name for e in entries if e.error is None
            and (e.facts is None or e.facts.kind != "head")]


# ----------------------------------------------------------------------------- handlers


def refresh() -> tuple[str, dict]:
    """The library's table and the target choices."""
    entries = list_library()
    cache = [cache_cell(entry_cache_use(e).sizes()) for e in entries]
    return library_html(entries, cache), gr.update(choices=_targets(entries))


def add(source: str, include: str) -> tuple[str, str, dict]:
    """Add a path, or download a repo id (``include``: a file pattern); a notice, the table
    and the target choices."""
    from tqdm.auto import tqdm

    from localspec.models.hub import download, looks_like_repo_id

    source = (source or "").strip()
    try:
        if source and Path(source).expanduser().exists():
            added = [add_path(source).name]
        elif looks_like_repo_id(source):
            patterns = [p for p in (include or "").split() if p]
            added = [str(p) for p in download(source, patterns or None, tqdm_class=tqdm)]
        else:
            raise InputFileError(f"{source!r}: no such file or folder, and not a Hugging Face "
                                 "repo id (org/name)")
        notice = f"added {', '.join(added)}"
    except LocalSpecError as exc:
        notice = f"⚠ {exc}"
    table, targets = refresh()
    return html.escape(notice), table, targets


def find(target: str | None) -> tuple[str, dict, str]:
    """The drafters for ``target``, the drafter choices, and a notice."""
    if not target:
        return "", gr.update(choices=[]), "choose a target first"
    try:
        report = find_drafters(target)
    except LocalSpecError as exc:
        return "", gr.update(choices=[]), html.escape(f"⚠ {exc}")
    keys = [c.key for c in report.choices]
    first = next((c.key for c in report.choices if c.fits), keys[0])
    return drafters_html(report), gr.update(choices=keys, value=first), ""


def make(target: str | None, drafter: str | None, name: str, choices: Choices
         ) -> tuple[str, dict]:
    """Save the preset ``name`` of ``target`` with ``drafter``; a notice and the preset
    dropdown's new choices (the new preset among them)."""
    try:
        if not target or not drafter:
            raise InputFileError("choose a target and find its drafters first")
        path = make_preset((name or "").strip(), find_drafters(target), drafter)
    except LocalSpecError as exc:
        return html.escape(f"⚠ {exc}"), gr.update()
    return html.escape(f"saved preset {name.strip()} ({path}): choose it in the preset list"), \
        gr.update(choices=choices())


# ----------------------------------------------------------------------------- layout


@dataclass
class ModelsTab:
    table: gr.HTML
    refresh: gr.Button
    source: gr.Textbox
    include: gr.Textbox
    add: gr.Button
    notice: gr.HTML
    target: gr.Dropdown
    find: gr.Button
    drafters: gr.HTML
    drafter: gr.Dropdown
    name: gr.Textbox
    make: gr.Button


def build_models_tab() -> ModelsTab:
    """The tab's components (inside a ``gr.Tab``); ``wire_models`` connects them."""
    table = gr.HTML("", elem_id="ls-models", js_on_load=None)
    refresh_button = gr.Button("Refresh", elem_id="ls-models-refresh")
    with gr.Row():
        source = gr.Textbox(label="Add: a .gguf file, a model folder, or a Hub repo (org/name)",
                            scale=3, elem_id="ls-models-source")
        include = gr.Textbox(label="files (GGUF repos), e.g. *Q4_K_M.gguf", scale=2,
                             elem_id="ls-models-include")
        add_button = gr.Button("Add", scale=1, elem_id="ls-models-add")
    notice = gr.HTML("", elem_id="ls-models-notice", js_on_load=None)
    with gr.Row():
        target = gr.Dropdown([], label="Target", scale=3, elem_id="ls-models-target")
        find_button = gr.Button("Find drafters", scale=1, elem_id="ls-models-find")
    drafters = gr.HTML("", elem_id="ls-models-drafters", js_on_load=None)
    with gr.Row():
        drafter = gr.Dropdown([], label="Drafter", scale=2, elem_id="ls-models-drafter")
        name = gr.Textbox(label="Preset name", scale=2, elem_id="ls-models-name")
        make_button = gr.Button("Make preset", scale=1, elem_id="ls-models-make")
    return ModelsTab(table, refresh_button, source, include, add_button, notice, target,
                     find_button, drafters, drafter, name, make_button)


def wire_models(tab: ModelsTab, preset: gr.Dropdown, choices: Choices, demo: gr.Blocks) -> None:
    """Connect the tab: ``preset`` is the preset dropdown a new preset is added to (its
    choices from ``choices``)."""
    def add_with_progress(source: str, include: str,
                          progress: gr.Progress = gr.Progress(track_tqdm=True)  # noqa: B008
                          ) -> tuple[str, str, dict]:
        return add(source, include)  # its tqdm bars show through ``progress``

    tab.refresh.click(refresh, None, [tab.table, tab.target], concurrency_id="models")
    tab.add.click(add_with_progress, [tab.source, tab.include], [tab.notice, tab.table,
                                                                 tab.target],
                  concurrency_limit=1, concurrency_id="models")
    tab.find.click(find, tab.target, [tab.drafters, tab.drafter, tab.notice],
                   concurrency_limit=1, concurrency_id="models")
    def make_preset_here(target: str | None, drafter: str | None, name: str
                         ) -> tuple[str, dict]:
        return make(target, drafter, name, choices)

    tab.make.click(make_preset_here, [tab.target, tab.drafter, tab.name], [tab.notice, preset],
                   concurrency_limit=1, concurrency_id="models")
    demo.load(refresh, None, [tab.table, tab.target], concurrency_id="models")
