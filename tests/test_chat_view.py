"""The conversation view (``localspec.ui.chat_view``) without a browser: the injection set in the
user's and the model's messages makes nothing that loads or runs, both views are there (the
rendered Markdown and the verbatim text), every message carries its exact source for Copy, and
only an answer still streaming holds back its half-typed markup."""

from __future__ import annotations

import random

import pytest
from test_markdown import INJECTIONS, Parsed, assert_safe
from test_ui_render import INJECTIONS as PLAIN_INJECTIONS

from localspec.ui.chat_view import (
    CHAT_CSS,
    MARKDOWN_MINE_ATTRIBUTE,
    RAW_ATTRIBUTE,
    chat_html,
    message_html,
    toggle_js,
)


def _messages(page: str) -> list[dict[str, str | None]]:
    """The attributes of each message element of a page."""
    return [attrs for tag, attrs in Parsed(page).tags
            if tag == "div" and "ls-msg " in f"{attrs.get('class')} "]


def _view_texts(page: str, view: str) -> list[str]:
    """The text of each message's ``view`` (ls-msg-md or ls-msg-text), as textContent has it."""
    return [text for _, attrs, _, text in Parsed(page).elements if attrs.get("class") == view]


@pytest.mark.parametrize("evil", INJECTIONS + PLAIN_INJECTIONS)
@pytest.mark.parametrize("streaming", [False, True])
def test_injections_in_user_and_model_messages_make_nothing_that_loads(evil: str,
                                                                       streaming: bool) -> None:
    history = [{"role": "user", "content": evil}, {"role": "assistant", "content": evil}]
    page = chat_html(history, streaming=streaming)
    parsed = assert_safe(page)
    assert all(a["href"].startswith(("http://127.0.0.1:9/", "mailto:a@b.c"))
               for _, a in parsed.tags if "href" in a)
    assert [m["data-ls-source"] for m in _messages(page)] == [evil, evil]
    assert _view_texts(page, "ls-msg-text") == [evil, evil]  # the verbatim view is exact
    assert len(_view_texts(page, "ls-msg-md")) == 2


def test_both_views_and_one_copy_button_per_message_and_code_block() -> None:
    answer = "# Plan\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\nx = 1\n```\n\n```\ny\n```"
    history = [{"role": "user", "content": "__init__ and 2*3*4"},
               {"role": "assistant", "content": answer},
               {"role": '"><img src=x>', "content": "odd role"}]
    page = chat_html(history)
    parsed = assert_safe(page)
    messages = _messages(page)
    assert [m["class"] for m in messages] == ["ls-msg ls-user", "ls-msg ls-assistant",
                                              "ls-msg ls-other"]
    assert [m["data-label"] for m in messages] == ["You", "LocalSpec", "Other"]
    assert _view_texts(page, "ls-msg-text") == [m["content"] for m in history]
    rendered = _view_texts(page, "ls-msg-md")
    assert len(rendered) == 2  # a role the chat does not know is shown verbatim only
    # Why the user's own messages show verbatim unless asked: Markdown eats these characters.
    assert rendered[0] == "init and 234\n" and "<strong>init</strong>" in page
    assert "<h1>Plan</h1>" in page and "<td>1</td>" in page and '<span class="n">x</span>' in page
    copies = [a["data-ls-copy"] for _, a in parsed.tags if "data-ls-copy" in a]
    assert sorted(copies) == ["all", "code", "code", "one", "one", "one"]


def _fuzz(count: int) -> list[str]:
    alphabet = ["<", ">", "&", "&amp;", '"', "'", "`", "```", "\n", "\r\n", "\r", " ", "    ",
                "\t", "#", "|", "-", "*", "_", "![a](http://e/x)", "[l](javascript:x)", "é",
                "€", "😀", "&#13;", "x"]
    rng = random.Random(21)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
            for _ in range(count)]


@pytest.mark.parametrize("text", _fuzz(200))
def test_each_message_carries_its_exact_source(text: str) -> None:
    """What Copy copies is the message as written: the ``data-ls-source`` attribute parses
    back to exactly the text, carriage returns and entity-like text included."""
    page = message_html("assistant", text)
    assert_safe(page)
    assert _messages(page)[0]["data-ls-source"] == text
    assert _view_texts(page, "ls-msg-text") == [text]


def test_only_an_answer_still_streaming_holds_back_its_markup() -> None:
    history = [{"role": "assistant", "content": "Done\n-"}, {"role": "user", "content": "Go\n-"},
               {"role": "assistant", "content": "Going\n-"}]
    streaming = chat_html(history, streaming=True)
    assert "<h2>Done</h2>" in streaming and "<h2>Go</h2>" in streaming
    assert "<h2>Going</h2>" not in streaming and "<p>Going</p>" in streaming
    assert "<h2>Going</h2>" in chat_html(history)
    # While the answer has no token yet, the user's message is the last: it is finished.
    assert "<h2>Go</h2>" in chat_html(history[:2], pending=True, streaming=True)


def test_the_page_styles_and_toggles_say_what_they_must() -> None:
    """The highlighting stylesheet is local and inert; each toggle's attribute is one the CSS
    reads, and its handler sets that attribute on the chat."""
    assert ".ls-hl .k {" in CHAT_CSS and ".dark #ls-chat .ls-hl .k {" in CHAT_CSS
    assert "url(" not in CHAT_CSS and "@import" not in CHAT_CSS
    for attribute in (RAW_ATTRIBUTE, MARKDOWN_MINE_ATTRIBUTE):
        assert f"[{attribute}]" in CHAT_CSS
        assert f"toggleAttribute('{attribute}'" in toggle_js(attribute)
