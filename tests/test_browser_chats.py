"""Saved conversations in a real browser (headless Chromium, set up as in tests/test_browser.py).

In-process, the app's own layout over SmolLM2 with scripted answers (so each answer is known):
the side list (newest first, titles shown as text and loading nothing), search, open and
continue, rename, export one as Markdown and all as JSON (real downloads), delete and undo,
import a JSON file; and two tabs sending at once, into their own conversations and into the
same one, losing nothing. Then ``app.py`` itself with the real model: a conversation survives a
restart, and an answer killed mid-stream (SIGKILL) comes back as its question and the part
said so far, marked cut.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from app_helpers import scripted_stream
from test_browser import (
    _skip_reason,
    browser_page,
    bubble,
    free_port,
    leak_server,
    running_app,
    send,
    wait_for_answer,
)

from localspec.chats.store import ChatStore
from localspec.config import DATA_ENV

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]
ANSWER = "Sure: here is what you asked for, in a few words."
STORY = "Write a very long story about a dragon and a knight, with many chapters."


def slowed(stream: Callable[..., Iterator], seconds: float) -> Callable[..., Iterator]:
    """``stream`` with a pause before each step: answers that overlap in time."""
    def slow(*args: object, **kwargs: object) -> Iterator:
        for event in stream(*args, **kwargs):
            time.sleep(seconds)
            yield event
    return slow


@contextmanager
def scripted_app(data: Path, pause_s: float = 0.0) -> Iterator[tuple[str, ChatStore]]:
    """The app in-process over SmolLM2 whose every answer is ``ANSWER``, saving into
    ``data``; yields its URL and its store."""
    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import APP_CSS, build_app

    host = ModelHost(warm_up=False)
    assert host.load("cpu-smollm2-ngram"), host.status().error
    host.pipeline.stream = slowed(scripted_stream(host.pipeline, ANSWER), pause_s)
    with ChatStore(data / "chats.db") as store:
        demo = build_app(host, detect_hardware(), "cpu-smollm2-ngram", store=store).queue()
        port = free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                    css=APP_CSS, ssr_mode=False, quiet=True)
        try:
            yield f"http://127.0.0.1:{port}/", store
        finally:
            demo.close()


def titles(page: object) -> list[str]:
    """The side list's titles, top to bottom (each label is "title · time")."""
    labels = page.locator("#ls-chats label").all_inner_texts()
    return [label.rsplit(" · ", 1)[0].strip() for label in labels]


def wait_for_titles(page: object, expected: list[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while titles(page) != expected:
        assert time.monotonic() < deadline, (titles(page), expected)
        page.wait_for_timeout(200)


def open_chat(page: object, title: str) -> None:
    """Open the conversation whose title starts with ``title``."""
    page.locator("#ls-chats label", has_text=title).click()
    page.wait_for_selector(f"#ls-chats-status:has-text(\"Opened '{title}\")", timeout=30_000)


def answer(page: object, text: str, answers: int) -> None:
    """Send ``text`` and wait until the chat shows ``answers`` answers and the summary."""
    send(page, text)
    page.wait_for_function(f"() => document.querySelectorAll('#ls-chat .ls-msg.ls-assistant')"
                           f".length === {answers}", timeout=60_000)
    wait_for_answer(page)


def download(page: object, button: str, says: str, name: str, tmp_path: Path) -> str:
    """Click an export button, wait for the panel to say ``says``, download the file it
    offers (``name``); its text."""
    page.click(button)
    page.wait_for_selector(f"#ls-chats-status:has-text('{says}')", timeout=30_000)
    link = page.locator(f'#ls-chat-file a.download-link[download="{name}"]')
    with page.expect_download() as info:
        link.click()
    path = tmp_path / name
    info.value.save_as(path)
    return path.read_text(encoding="utf-8")


def rename(page: object, title: str, tries: int = 3) -> None:
    """Type ``title`` in the rename box and press Rename until the panel says it renamed. In
    one full-suite run on a loaded 2-core machine the list kept the old title after Rename
    (not reproduced alone, nor beside two busy processes): a second try, after checking that
    the box holds what was typed, tells a lost click from a rename that does not work, which
    fails every try."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = page.locator("#ls-chat-title input, #ls-chat-title textarea")
    for attempt in range(tries):
        box.fill(title)
        page.wait_for_timeout(300)
        if box.input_value() != title:  # a refresh wrote into the box meanwhile
            continue
        page.click("#ls-chat-rename")
        try:
            page.wait_for_selector(f"#ls-chats-status:has-text(\"Renamed to '{title}'\")",
                                   timeout=10_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise


def test_list_search_rename_export_delete_undo_import(tmp_path: Path) -> None:
    with leak_server() as (leak_port, leaked), scripted_app(tmp_path) as (url, store), \
            browser_page() as page:
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url)
        page.wait_for_selector("#ls-chats-status:has-text('Saved on this computer')")
        evil = f'Markup <img src="http://127.0.0.1:{leak_port}/title"> <b>title</b>'
        answer(page, evil, 1)
        wait_for_titles(page, [evil])  # shown as text: nothing made of it
        assert page.locator("#ls-chats img, #ls-chats b").count() == 0
        page.click("#ls-chat-new")
        page.wait_for_function("() => !document.querySelector('#ls-chat .ls-msg')")
        answer(page, "Tell me about dragons", 1)
        wait_for_titles(page, ["Tell me about dragons", evil])  # newest first

        page.fill("#ls-chat-search input, #ls-chat-search textarea", "DRAGON")
        wait_for_titles(page, ["Tell me about dragons"])
        page.fill("#ls-chat-search input, #ls-chat-search textarea", "")
        wait_for_titles(page, ["Tell me about dragons", evil])

        open_chat(page, "Markup")  # continue the older one: it moves to the top
        assert bubble(page, "user", 0).locator(".ls-msg-text").inner_text() == evil
        answer(page, "And one more thing?", 2)
        wait_for_titles(page, [evil, "Tell me about dragons"])
        (first,) = [s.id for s in store.list("markup")]
        assert [m.role for m in store.get(first).messages] == \
            ["user", "assistant", "user", "assistant"]

        page.click("#ls-chat-tools")  # the accordion: rename, delete, export, import
        rename(page, "Renamed in the browser")
        wait_for_titles(page, ["Renamed in the browser", "Tell me about dragons"])

        markdown = download(page, "#ls-chat-export", "Exported 1 conversation as Markdown",
                            f"localspec-chat-{first}.md", tmp_path)
        assert markdown.startswith("# Renamed in the browser\n") and "dragons" not in markdown
        assert "And one more thing?" in markdown and "preset `cpu-smollm2-ngram`" in markdown
        page.locator("#ls-chat-format label", has_text="JSON").click()
        everything = json.loads(download(page, "#ls-chat-export-all",
                                         "Exported 2 conversations as JSON",
                                         "localspec-chats.json", tmp_path))
        assert [c["title"] for c in everything["conversations"]] == \
            ["Tell me about dragons", "Renamed in the browser"]

        page.click("#ls-chat-delete")
        page.wait_for_selector("#ls-chats-status:has-text(\"Deleted 'Renamed in the browser'\")")
        wait_for_titles(page, ["Tell me about dragons"])
        assert page.locator("#ls-chat .ls-msg").count() == 0
        page.click("#ls-chat-undo")
        wait_for_titles(page, ["Renamed in the browser", "Tell me about dragons"])
        assert page.locator("#ls-chat .ls-msg").count() == 4  # opened again

        imported = everything["conversations"][0]
        imported.update(id="from-another-machine", title="Imported one")
        upload = tmp_path / "upload.json"
        upload.write_text(json.dumps({**everything, "conversations": [imported]}),
                          encoding="utf-8")
        with page.expect_file_chooser() as chooser:
            page.click("#ls-chat-import")
        chooser.value.set_files(str(upload))
        page.wait_for_selector("#ls-chats-status:has-text('Imported 1 conversation')",
                               timeout=30_000)
        assert "Imported one" in titles(page)
        page.wait_for_timeout(500)
        assert leaked == [] and not [u for u in requests if f":{leak_port}/" in u]


def test_two_tabs_at_once_lose_nothing(tmp_path: Path) -> None:
    """Two tabs send at the same moment (one answer waits for the other), first into their
    own conversations, then both into the same one: every message is saved, each once."""
    with scripted_app(tmp_path, pause_s=0.05) as (url, store), browser_page() as one:
        two = one.context.new_page()
        for page in (one, two):
            page.goto(url)
            page.wait_for_selector("#ls-status:has-text('Active preset')", timeout=120_000)
        for page, text in ((one, "Question from tab one"), (two, "Question from tab two")):
            page.fill("#ls-message textarea", text)
        one.click("#ls-send")
        two.click("#ls-send")
        for page in (one, two):
            wait_for_answer(page, 60_000)
        assert sorted(s.title for s in store.list()) == \
            ["Question from tab one", "Question from tab two"]
        two.click("#ls-chat-new")  # the list is drawn again: tab one's is there too
        open_chat(two, "Question from tab one")
        for page, text in ((one, "Tab one again"), (two, "Tab two joins in")):
            page.fill("#ls-message textarea", text)
        one.click("#ls-send")
        two.click("#ls-send")
        for page in (one, two):
            page.wait_for_function("() => document.querySelectorAll("
                                   "'#ls-chat .ls-msg.ls-assistant').length === 2",
                                   timeout=60_000)
            wait_for_answer(page, 60_000)
        (shared,) = [s.id for s in store.list("tab one")]
        messages = store.get(shared).messages
        questions = [m.content for m in messages if m.role == "user"]
        assert questions[0] == "Question from tab one" and len(messages) == 6
        assert sorted(questions[1:]) == ["Tab one again", "Tab two joins in"]
        assert all(m.complete and m.content for m in messages)


def app_pid(port: int) -> int:
    """The process id of the ``app.py`` this test started on ``port``."""
    for child in psutil.Process().children():
        if "app.py" in " ".join(child.cmdline()) and str(port) in child.cmdline():
            return child.pid
    raise AssertionError(f"no app.py on port {port} among this test's processes")


def test_a_conversation_survives_a_restart_and_a_kill_mid_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))  # app.py saves here
    port = free_port()
    with running_app("cpu-smollm2-ngram", port, tmp_path / "first.log") as url, \
            browser_page() as page:
        page.goto(url)
        answer(page, "Say hi.", 1)
        said = bubble(page, "assistant").locator(".ls-msg-text").inner_text()
        page.click("#ls-chat-new")
        send(page, STORY)
        page.wait_for_function("() => document.querySelectorAll('#ls-tokens span.ls-tok')"
                               ".length >= 60", timeout=120_000)
        page.wait_for_timeout(1000)  # past a save (every 32 tokens or 0.5 s)
        shown = bubble(page, "assistant").locator(".ls-msg-text").inner_text()
        os.kill(app_pid(port), signal.SIGKILL)
    with ChatStore(tmp_path / "data" / "chats.db") as store:
        story, hello = store.list()
        question, cut = store.get(story.id).messages
        greeting = store.get(hello.id).messages
    assert question.content == STORY and not cut.complete and cut.finish_reason is None
    assert len(cut.content) > 20 and shown.startswith(cut.content.strip()[:20])
    assert greeting[0].content == "Say hi." and greeting[1].content == said

    with running_app("cpu-smollm2-ngram", free_port(), tmp_path / "second.log") as url, \
            browser_page() as page:
        page.goto(url)
        page.wait_for_selector("#ls-chats-status:has-text('Saved on this computer')")
        wait_for_titles(page, [story.title, "Say hi."])
        open_chat(page, story.title)
        assert "1 answer cut short" in page.inner_text("#ls-chats-status")
        assert bubble(page, "user", 0).locator(".ls-msg-text").inner_text() == STORY
        assert bubble(page, "assistant").locator(".ls-msg-text").inner_text() == cut.content
        open_chat(page, "Say hi.")
        assert bubble(page, "assistant").locator(".ls-msg-text").inner_text() == said
        answer(page, "Now say bye.", 2)  # goes on with it, with the preset loaded
        wait_for_titles(page, ["Say hi.", story.title])
    for log in ("first.log", "second.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
    with ChatStore(tmp_path / "data" / "chats.db") as store:
        messages = store.get(hello.id).messages
    assert [m.content for m in messages if m.role == "user"] == ["Say hi.", "Now say bye."]
    assert messages[-1].complete and messages[-1].preset == "cpu-smollm2-ngram"
