"""One real-browser test: ``python app.py`` on loopback with the small real model, driven by
headless Chromium (Debian's ``chromium`` package through Playwright; Playwright's own browser
download does not work offline). It sends a message and checks that coloured token spans and a
tokens/s figure appear, then points the app at a broken preset file and checks the error shows
while the previous preset stays active.

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
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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
            yield browser.new_page(viewport={"width": width, "height": height})
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


@pytest.mark.real_model
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_app_in_a_real_browser(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text(BROKEN_PRESET, encoding="utf-8")
    with running_app("cpu-smollm2-ngram", free_port(), tmp_path / "app.log") as url, \
            browser_page() as page:
        page.goto(url)
        # The page is up at once and says what is loading or active.
        page.wait_for_selector("#ls-status .ls-status", timeout=60_000)
        send(page, PROMPT)
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
        answer = page.inner_text("#ls-chat")
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

        # A broken preset file: an error the user can act on; the previous preset stays.
        page.fill("#ls-preset-path textarea, #ls-preset-path input", str(broken))
        page.click("#ls-load-path")
        page.wait_for_selector("#ls-status .ls-error", timeout=60_000)
        status = page.inner_text("#ls-status")
        assert "not valid TOML" in status, status
        assert "SmolLM2" in status  # still the active preset


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
