"""Real-browser tests, driven by headless Chromium (Debian's ``chromium`` package through
Playwright; Playwright's own browser download does not work offline).

``python app.py`` on loopback with the small real model: a message full of Markdown, HTML and
indented code, typed with Shift+Enter between lines and sent with Enter, shows verbatim (the
user's messages do unless asked), makes the browser fetch nothing (a local server stands in for
an attacker's) and copies exactly; then coloured token spans and a tokens/s figure, Stop
mid-answer, and a broken preset file whose error shows while the previous preset stays active.
A second test serves the same layout in-process with a scripted answer, so that the
*assistant's* text is known: it renders as Markdown that loads nothing, copies exactly, and the
raw toggle shows it verbatim. ``test_browser_markdown`` checks the rendering in full.

Also a script for the README screenshot:
``python tests/test_browser.py --preset cpu-qwen-coder-draft --screenshot docs/screenshot.png``
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PROMPT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
          "river bank.")
CODE_PROMPT = ("Write a short Python function that checks whether a string is a palindrome, "
               "ignoring case and spaces. Just the code, no explanation.")
BROKEN_PRESET = 'name = "broken"\n[target\nmodel = "x"\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(preset: str, port: int, log: Path, timeout: float = 120) -> Iterator[str]:
    """``python app.py`` in a subprocess; yields its URL once the page answers."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    url = f"http://127.0.0.1:{port}/"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--preset", preset, "--no-browser", "--port", str(port)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"app.py exited with {proc.returncode}:\n{log.read_text()}")
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"app.py did not answer in {timeout} s:\n{log.read_text()}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height},
                                          permissions=["clipboard-read", "clipboard-write"])
            yield context.new_page()
        finally:
            browser.close()


def send(page: object, text: str, load_timeout_ms: int = 300_000) -> None:
    page.wait_for_selector("#ls-status:has-text('Active preset')", timeout=load_timeout_ms)
    page.fill("#ls-message textarea", text)
    page.click("#ls-send")


def wait_for_answer(page: object, timeout_ms: int = 180_000) -> None:
    page.wait_for_selector("#ls-summary:has-text('tok/s')", timeout=timeout_ms)


def _skip_reason() -> str | None:
    if not CHROMIUM.is_file():
        return ("Debian's chromium is not installed (/usr/bin/chromium): "
                "apt-get install -y chromium (.ci/run does this)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -r requirements.txt"
    return None


@contextmanager
def leak_server() -> Iterator[tuple[int, list[str]]]:
    """A tiny local HTTP server standing in for an attacker's: yields (port, paths requested)."""
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/gif")
            self.end_headers()
            self.wfile.write(b"GIF89a")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], requested
    finally:
        server.shutdown()
        server.server_close()


def evil_text(port: int) -> str:
    """Markdown, HTML and indented code that must show as typed and load nothing."""
    return (f"Repeat exactly, with nothing else: ![x](http://127.0.0.1:{port}/leak-md) "
            f'<img src="http://127.0.0.1:{port}/leak-img"> <b>bold</b> &amp;\n'
            "```python\ndef f(x):\n    if x < 1:\n        return x\n```")


def type_multiline(page: object, text: str) -> None:
    """Type ``text`` into the message box as a user does: Shift+Enter between lines."""
    box = page.locator("#ls-message textarea")
    box.click()
    for i, line in enumerate(text.split("\n")):
        if i:
            page.keyboard.press("Shift+Enter")
        page.keyboard.type(line)


def bubble(page: object, role: str, index: int = -1) -> object:
    messages = page.locator(f"#ls-chat .ls-msg.ls-{role}")
    return messages.nth(index if index >= 0 else messages.count() + index)


def assert_shown_verbatim(page: object, role: str, text: str) -> None:
    """The bubble's text is exactly ``text``: no element made from it, whitespace kept."""
    body = bubble(page, role).locator(".ls-msg-text")
    assert body.evaluate("e => e.textContent") == text
    shown = body.inner_text()  # what a selection copies: the same, whitespace kept
    assert shown == text and "<b>bold</b>" in shown and "        return x" in shown, shown
    assert body.evaluate("e => e.querySelectorAll('img, b, a, script, iframe').length") == 0
    assert page.locator("#ls-chat img").count() == 0


def clipboard_after(page: object, button: object) -> str:
    page.evaluate("navigator.clipboard.writeText('')")
    button.click()
    page.wait_for_function("async () => (await navigator.clipboard.readText()) !== ''",
                           timeout=5_000)
    return page.evaluate("navigator.clipboard.readText()")


@pytest.mark.real_model
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_app_in_a_real_browser(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text(BROKEN_PRESET, encoding="utf-8")
    with leak_server() as (leak_port, leaked), \
            running_app("cpu-smollm2-ngram", free_port(), tmp_path / "app.log") as url, \
            browser_page() as page:
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url)
        # The page is up at once and says what is loading or active.
        page.wait_for_selector("#ls-status .ls-status", timeout=60_000)
        page.wait_for_selector("#ls-status:has-text('Active preset')", timeout=300_000)
        assert f"{url}v1" in page.inner_text("#ls-api")  # where the API of this server is

        # Shift+Enter starts a new line and does not send; Enter sends.
        text = evil_text(leak_port)
        type_multiline(page, text)
        page.wait_for_timeout(500)
        assert page.input_value("#ls-message textarea") == text
        assert page.locator("#ls-chat .ls-msg").count() == 0
        page.keyboard.press("Enter")
        page.wait_for_selector("#ls-chat .ls-msg.ls-user", timeout=30_000)
        assert page.input_value("#ls-message textarea") == ""
        assert_shown_verbatim(page, "user", text)
        wait_for_answer(page)
        assert clipboard_after(page, bubble(page, "user").locator("[data-ls-copy=one]")) == text

        # A fresh conversation: the evil text holds a random port, and a 135M model's answer
        # to the next prompt must not hang on what it made of that (it once did, in a full run)
        page.click("#ls-clear")
        page.wait_for_function("() => document.querySelectorAll('#ls-chat .ls-msg').length === 0")
        page.fill("#ls-message textarea", PROMPT)
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => document.querySelectorAll('#ls-chat .ls-msg.ls-user').length === 1")
        wait_for_answer(page)
        spans = page.locator("#ls-tokens span.ls-tok")
        assert spans.count() >= 3
        kinds = set(page.eval_on_selector_all(
            "#ls-tokens span.ls-tok", "els => els.map(e => e.className)"))
        assert any("ls-accepted" in k for k in kinds), kinds  # n-gram copies the sentence
        accepted = page.locator("#ls-tokens span.ls-accepted").first
        colour = accepted.evaluate("e => getComputedStyle(e).backgroundColor")
        assert colour == "rgb(187, 247, 208)", colour  # the legend's green, CSS applied
        title = accepted.get_attribute("title") or ""
        assert "step" in title and "p_target=" in title and "q_draft=" in title

        stats = page.inner_text("#ls-stats")
        match = re.search(r"tokens/s \(average\)\s+([0-9.]+)", stats)
        assert match and float(match.group(1)) > 0, stats
        answer = bubble(page, "assistant").locator(".ls-msg-md").inner_text()
        assert "quick brown fox" in answer
        page.screenshot(path=str(tmp_path / "app.png"), full_page=True)

        # Stop mid-answer: the answer ends within a step and says so.
        page.fill("#ls-message textarea", "Write a long story about a dragon and a knight.")
        page.click("#ls-send")
        page.wait_for_function(
            "() => document.querySelector('#ls-summary').innerText === '' && "
            "document.querySelectorAll('#ls-tokens span.ls-tok').length >= 5", timeout=60_000)
        page.click("#ls-stop")
        page.wait_for_selector("#ls-summary:has-text('stopped: cancelled')", timeout=60_000)
        assert "Stopped." in page.inner_text("#ls-notice")

        # Clear mid-answer: the conversation goes and stays gone; the next one is answered.
        page.fill("#ls-message textarea", "Write a long story about a dragon and a knight.")
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => document.querySelector('#ls-summary').innerText === '' && "
            "document.querySelectorAll('#ls-tokens span.ls-tok').length >= 3", timeout=60_000)
        page.click("#ls-clear")
        page.wait_for_timeout(2000)
        assert page.locator("#ls-chat .ls-msg").count() == 0
        send(page, "Say hi.")
        wait_for_answer(page)
        assert page.locator("#ls-chat .ls-msg.ls-assistant").count() == 1

        # A broken preset file: an error the user can act on; the previous preset stays.
        page.fill("#ls-preset-path textarea, #ls-preset-path input", str(broken))
        page.click("#ls-load-path")
        page.wait_for_selector("#ls-status .ls-error", timeout=60_000)
        status = page.inner_text("#ls-status")
        assert "not valid TOML" in status, status
        assert "SmolLM2" in status  # still the active preset

        page.wait_for_timeout(1000)
        assert leaked == [], leaked  # (a) nothing in a message made the browser fetch
        assert not [u for u in requests if f":{leak_port}/" in u], requests
    log = (tmp_path / "app.log").read_text()
    assert "Traceback" not in log, log


@pytest.mark.real_model
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_assistant_markup_is_shown_not_loaded(tmp_path: Path) -> None:
    """The app's own layout and handlers in-process, the model's answer scripted (so the
    assistant's text is known): it renders as Markdown (the image a link, the HTML text, the
    code exact), loads nothing, copies exactly, and shows verbatim under "show raw text"."""
    from app_helpers import scripted_stream

    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import APP_CSS, build_app

    with leak_server() as (leak_port, leaked):
        text = evil_text(leak_port)
        host = ModelHost(warm_up=False)
        assert host.load("cpu-smollm2-ngram"), host.status().error
        host.pipeline.stream = scripted_stream(host.pipeline, text)
        demo = build_app(host, detect_hardware(), "cpu-smollm2-ngram").queue()
        port = free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                    css=APP_CSS, ssr_mode=False, quiet=True)
        try:
            with browser_page() as page:
                requests: list[str] = []
                page.on("request", lambda r: requests.append(r.url))
                page.goto(f"http://127.0.0.1:{port}/")
                send(page, "Say it.")
                wait_for_answer(page)
                expected = host.pipeline.tokenizer.decode(
                    host.pipeline.tokenizer.encode(text, add_special_tokens=False),
                    skip_special_tokens=True)
                rendered = bubble(page, "assistant").locator(".ls-msg-md")
                shown = rendered.inner_text()
                assert "🖼 x (127.0.0.1)" in shown and f'<img src="http://127.0.0.1:{leak_port}' \
                    f'/leak-img"> <b>bold</b> &' in shown, shown
                assert rendered.locator("a.ls-image").get_attribute("target") == "_blank"
                assert rendered.locator("code").evaluate("e => e.textContent") == (
                    "def f(x):\n    if x < 1:\n        return x\n")
                assert page.locator("#ls-chat img, #ls-chat b").count() == 0
                copy = bubble(page, "assistant").locator("[data-ls-copy=one]")
                assert clipboard_after(page, copy) == expected
                everything = clipboard_after(page, page.locator("[data-ls-copy=all]"))
                assert everything == f"You:\nSay it.\n\nLocalSpec:\n{expected}"
                page.click("#ls-raw input")
                bubble(page, "assistant").locator(".ls-msg-text").wait_for(state="visible")
                assert_shown_verbatim(page, "assistant", expected)
                page.wait_for_timeout(1000)
                assert leaked == [], leaked
                assert not [u for u in requests if f":{leak_port}/" in u], requests
        finally:
            demo.close()


def _screenshot(preset: str, path: Path, prompt: str) -> None:
    """Take the README screenshot: a real answer with colours and the live readout."""
    log = Path("/tmp/localspec-screenshot-app.log")
    with running_app(preset, free_port(), log) as url, browser_page(1400, 1100) as page:
        page.goto(url)
        send(page, prompt, load_timeout_ms=900_000)
        wait_for_answer(page, 600_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(path), full_page=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-draft")
    parser.add_argument("--screenshot", type=Path, default=REPO / "docs" / "screenshot.png")
    parser.add_argument("--prompt", default=CODE_PROMPT)
    args = parser.parse_args()
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    _screenshot(args.preset, args.screenshot, args.prompt)
