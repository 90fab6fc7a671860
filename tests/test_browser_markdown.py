"""Rendered Markdown in a real browser (headless Chromium, the setup of ``test_browser``): the
app's own layout and handlers in-process, the model's answer scripted so that what it says is
known. The injection set in the user's message and in the answer makes the page request nothing
outside the app's own origin (a local server standing in for an attacker's receives nothing),
while ordinary Markdown renders (headings, table cells, pygments' token spans with their
colours); a message's Copy, a code block's Copy and Copy all copy the source; the raw toggle
shows the verbatim text and holds across the next answer; the user's messages render when
asked.

Also a script for the screenshot of the chat (``docs/screenshot-markdown.png``):
``python tests/test_browser_markdown.py --screenshot docs/screenshot-markdown.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_browser import (
    REPO,
    _skip_reason,
    browser_page,
    bubble,
    clipboard_after,
    free_port,
    leak_server,
    send,
    wait_for_answer,
)

PRESET = "cpu-smollm2-ngram"
CODE = ("def is_palindrome(text: str) -> bool:\n"
        "    letters = [c.lower() for c in text if c.isalnum()]\n"
        "\treturn letters == letters[::-1]  # <b>not bold</b> & kept\n")
ANSWER = ("# Palindromes\n\n## How to check\n\nA *palindrome* reads the same **both ways**:\n\n"
          "| input | palindrome? |\n|:--|:-:|\n| Racecar | yes |\n| abc | no |\n\n"
          f"```python\n{CODE}```\n\n> Note: `str.isalnum` keeps `<digits>` too.\n\n"
          "- see [the docs](https://docs.python.org/3/library/stdtypes.html)\n")


def injections(port: int) -> str:
    """Everything that could make a browser fetch, aimed at the leak server on ``port``."""
    leak = f"http://127.0.0.1:{port}"
    return (f"![chart]({leak}/md-image) ![ref][r] <img src=\"{leak}/img\"> "
            f"<script src=\"{leak}/script\"></script> <iframe src=\"{leak}/iframe\"></iframe> "
            f"<svg><image href=\"{leak}/svg\"/></svg> <link rel=stylesheet href=\"{leak}/css\"> "
            f"<style>body {{ background: url({leak}/style-url) }}</style> "
            f"<div style=\"background:url({leak}/attr-url)\">x</div> "
            f"<video poster=\"{leak}/poster\"></video> <object data=\"{leak}/object\"></object> "
            f"[js](javascript:fetch('{leak}/js')) [data](data:text/html,<img src={leak}/data>) "
            f"<{leak}/autolink> &lt;img src={leak}/entity&gt; ${{1+1}} {{{{x}}}}\n\n"
            f"[r]: {leak}/reference-image\n")


@contextmanager
def scripted_app(answer: str) -> Iterator[str]:
    """The app in-process over SmolLM2, answering ``answer`` to anything; yields its URL."""
    from app_helpers import scripted_stream

    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import APP_CSS, build_app

    host = ModelHost(warm_up=False)
    assert host.load(PRESET), host.status().error
    host.pipeline.stream = scripted_stream(host.pipeline, answer)
    demo = build_app(host, detect_hardware(), PRESET).queue()
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                css=APP_CSS, ssr_mode=False, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def assert_nothing_can_load(page: object) -> None:
    """No element in the chat that loads or runs anything; links only http(s)/mailto, opened
    in a new tab without opener or referrer; no style attribute."""
    chat = page.locator("#ls-chat .ls-chat")
    assert chat.evaluate("e => e.querySelectorAll('img, script, iframe, svg, style, link, "
                         "video, audio, object, embed, source, form, input, [style], [src]')"
                         ".length") == 0
    links = chat.evaluate("e => Array.from(e.querySelectorAll('[href]')).map(a => "
                          "[a.tagName, a.getAttribute('href'), a.target, a.rel])")
    assert links, "the answer's links are links"
    for tag, href, target, rel in links:
        assert tag == "A" and href.startswith(("http://", "https://", "mailto:")), href
        assert target == "_blank" and {"noopener", "noreferrer"} <= set(rel.split()), rel


def source_of(page: object, role: str) -> str:
    return bubble(page, role).evaluate("e => e.dataset.lsSource")


@pytest.mark.real_model
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_markdown_renders_copies_the_source_and_fetches_nothing() -> None:
    with leak_server() as (leak_port, leaked):
        evil = injections(leak_port)
        with scripted_app(ANSWER + "\n" + evil) as url, browser_page() as page:
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url)
            send(page, evil)
            wait_for_answer(page)
            answer = source_of(page, "assistant")
            assert answer.startswith("# Palindromes") and evil.strip() in answer
            assert source_of(page, "user") == evil.strip()  # the box's text, as sent

            # Rendered: headings, table cells, highlighted code, the image as a link.
            rendered = bubble(page, "assistant").locator(".ls-msg-md")
            assert rendered.is_visible()
            assert not bubble(page, "assistant").locator(".ls-msg-text").is_visible()
            assert rendered.locator("h1").inner_text() == "Palindromes"
            assert rendered.locator("h2").inner_text() == "How to check"
            cells = rendered.locator("td").all_inner_texts()
            assert cells == ["Racecar", "yes", "abc", "no"]
            code = rendered.locator(".ls-codeblock code")
            assert code.evaluate("e => e.textContent") == CODE  # tab and indentation kept
            keyword = code.locator("span.k").first
            assert keyword.inner_text() == "def"
            assert keyword.evaluate("e => getComputedStyle(e).color") == "rgb(0, 128, 0)"
            assert rendered.locator("strong").first.inner_text() == "both ways"
            image = rendered.locator("a.ls-image").first
            assert image.inner_text() == "🖼 chart (127.0.0.1)"
            assert "<img src=" in rendered.inner_text()  # raw HTML is shown as text
            assert "${1+1} {{x}}" in rendered.inner_text()  # no template reads it
            # The user's message is shown as typed until asked otherwise.
            user = bubble(page, "user")
            assert user.locator(".ls-msg-text").evaluate("e => e.textContent") == evil.strip()
            assert not user.locator(".ls-msg-md").is_visible()
            assert_nothing_can_load(page)

            # Copy: the message's source, the block's code, the whole conversation.
            assert clipboard_after(page, bubble(page, "assistant").locator(
                "[data-ls-copy=one]")) == answer
            assert clipboard_after(page, rendered.locator("[data-ls-copy=code]")) == CODE
            assert clipboard_after(page, page.locator("[data-ls-copy=all]")) == (
                f"You:\n{evil.strip()}\n\nLocalSpec:\n{answer}")

            # The user's own messages rendered too, on request.
            page.click("#ls-md-mine input")
            page.wait_for_function("() => document.querySelector('#ls-chat')"
                                   ".hasAttribute('data-ls-md-mine')")
            assert user.locator(".ls-msg-md").is_visible()
            assert user.locator(".ls-msg-md a.ls-image").first.inner_text() == "🖼 chart (127.0.0.1)"
            assert_nothing_can_load(page)

            # Raw text: every message verbatim; it holds across the next answer.
            page.click("#ls-raw input")
            raw = bubble(page, "assistant").locator(".ls-msg-text")
            raw.wait_for(state="visible")
            assert raw.inner_text() == answer and not rendered.is_visible()
            assert user.locator(".ls-msg-text").inner_text() == evil.strip()
            send(page, "Again.")
            page.wait_for_function(
                "() => document.querySelectorAll('#ls-chat .ls-assistant').length === 2")
            wait_for_answer(page)
            assert bubble(page, "assistant").locator(".ls-msg-text").inner_text() == answer
            assert not bubble(page, "assistant").locator(".ls-msg-md").is_visible()
            page.click("#ls-raw input")
            bubble(page, "assistant").locator(".ls-msg-md").wait_for(state="visible")

            page.wait_for_timeout(1000)
            origin = url.rstrip("/")
            assert leaked == [], leaked
            assert [u for u in requests if not u.startswith(origin)] == [], requests


def _screenshot(path: Path) -> None:
    """The chat with a rendered answer, down to its view switches, for docs/app.md and the
    README (the readout is left out: a scripted answer's tokens/s mean nothing)."""
    with scripted_app(ANSWER) as url, browser_page(1400, 1000) as page:
        page.goto(url)
        send(page, "How do I check for a palindrome in Python?")
        wait_for_answer(page)
        page.wait_for_timeout(1000)
        top = page.locator("#ls-chat").bounding_box()
        bottom = page.locator("#ls-md-mine").bounding_box()
        page.screenshot(path=str(path), clip={
            "x": top["x"] - 8, "y": top["y"] - 8, "width": top["width"] + 16,
            "height": bottom["y"] + bottom["height"] - top["y"] + 16})
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # as a script, the checkout's localspec
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--screenshot", type=Path,
                        default=REPO / "docs" / "screenshot-markdown.png")
    _screenshot(parser.parse_args().screenshot)
