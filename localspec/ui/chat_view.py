"""The conversation as inert, escaped HTML: what a message says is shown, never interpreted.

Why not ``gr.Chatbot``: in Gradio 6.31 it renders every message as Markdown/HTML (an image in
an answer is fetched: the answer can leak the conversation to any server), and its options
cannot fix that without breaking something else. ``render_markdown=False`` still hands the text
to the browser as HTML (``<b>`` turns bold, ``<img>`` loads); ``allow_tags`` escapes only the
tags it is given (``i<n`` in code then swallows the rest of the answer); escaping the text
ourselves makes its copy buttons copy ``&lt;b&gt;``, since they copy the stored value.

So the chat is a ``gr.HTML`` whose every character of message text goes through
``html.escape``: the only elements on the page are the ones this module writes (no ``src``, no
``href``, no ``style``), so nothing in a message can make the browser fetch anything. Whitespace
is kept by CSS (``pre-wrap``); fenced code blocks are set off in monospace, fences included, so
the text of each message (its ``textContent``) is exactly what was said, and the copy buttons
(``CHAT_JS``) copy that. Conversation state lives in a ``gr.State`` of plain-text messages;
this HTML is only its view. No Gradio here: pure functions, tested without a browser.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence

ROLE_LABELS = {"user": "You", "assistant": "LocalSpec"}
EMPTY_TEXT = "No messages yet. Enter sends; Shift+Enter starts a new line."
# A fence opens a code block: up to 3 spaces, then 3+ backticks or tildes (CommonMark).
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_CLOSING = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*(\r\n|\r|\n)?")

CHAT_CSS = """
#ls-chat .ls-chat { border: 1px solid var(--border-color-primary); border-radius: 8px; }
#ls-chat .ls-chat-bar { display: flex; justify-content: space-between; align-items: center;
  padding: 4px 8px; font-size: 0.85em; border-bottom: 1px solid var(--border-color-primary); }
#ls-chat .ls-chat-log { height: 360px; overflow-y: auto; display: flex;
  flex-direction: column-reverse; padding: 6px 8px; }
#ls-chat .ls-msg { margin: 6px 0; padding: 6px 10px; border-radius: 8px; max-width: 92%; }
#ls-chat .ls-user { background: var(--background-fill-secondary); margin-left: auto; }
#ls-chat .ls-assistant { border: 1px solid var(--border-color-primary); }
#ls-chat .ls-msg-head { display: flex; justify-content: space-between; gap: 12px;
  font-size: 0.75em; opacity: 0.75; }
#ls-chat .ls-msg-text { white-space: pre-wrap; overflow-wrap: anywhere; }
/* inline-block, not block: a block adds line breaks to innerText (what a text selection copies),
   so the code would copy with blank lines that were never said. */
#ls-chat .ls-code { display: inline-block; width: 100%; box-sizing: border-box;
  vertical-align: top; white-space: pre-wrap; font-family: ui-monospace,
  SFMono-Regular, Menlo, monospace; font-size: 0.9em; background: var(--code-background-fill,
  rgba(127, 127, 127, 0.12)); border-radius: 4px; padding: 4px 6px; }
#ls-chat .ls-fence { opacity: 0.5; }
#ls-chat .ls-copy { cursor: pointer; font-size: 0.85em; padding: 0 6px; border-radius: 4px;
  border: 1px solid var(--border-color-primary); background: transparent; }
#ls-chat .ls-copy[data-copied] { background: #bbf7d0; }
#ls-chat .ls-chat-empty, #ls-chat .ls-pending { opacity: 0.6; font-style: italic; }
"""

# Runs once when the page loads (gr.HTML's ``js_on_load``; ``element`` is the component). One
# listener for every copy button, present and future: the HTML is re-rendered as the answer
# streams. It copies ``textContent``, i.e. the message text exactly as said, never markup.
CHAT_JS = """
const textOf = (message) => message.querySelector('.ls-msg-text').textContent;
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement('textarea');
  area.value = text;
  area.setAttribute('readonly', '');
  area.style.position = 'fixed';
  area.style.left = '-9999px';
  document.body.appendChild(area);
  area.select();
  try { document.execCommand('copy'); } finally { area.remove(); }
}
element.addEventListener('click', async (event) => {
  const button = event.target.closest('[data-ls-copy]');
  if (!button || !element.contains(button)) return;
  let text;
  if (button.dataset.lsCopy === 'all') {
    const messages = Array.from(element.querySelectorAll('.ls-msg'));
    text = messages.map((m) => m.dataset.label + ':\\n' + textOf(m)).join('\\n\\n');
  } else {
    text = textOf(button.closest('.ls-msg'));
  }
  try {
    await copyText(text);
    button.dataset.copied = '1';
    setTimeout(() => { delete button.dataset.copied; }, 1500);
  } catch (err) {
    console.error('LocalSpec: copying failed', err);
  }
});
"""


def code_segments(text: str) -> list[tuple[str, bool]]:
    """``text`` cut into (piece, is_code): fenced code blocks, fence lines included, and the
    prose between them. The pieces join to exactly ``text`` (an unclosed fence runs to the
    end, as in CommonMark)."""
    segments: list[tuple[str, bool]] = []
    current: list[str] = []
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        if fence is None:
            opening = _FENCE.match(line)
            if opening is not None:
                if current:
                    segments.append(("".join(current), False))
                current, fence = [line], opening.group(1)
            else:
                current.append(line)
            continue
        current.append(line)
        closing = _CLOSING.fullmatch(line)
        if (closing is not None and closing.group(1)[0] == fence[0]
                and len(closing.group(1)) >= len(fence)):
            segments.append(("".join(current), True))
            current, fence = [], None
    if current:
        segments.append(("".join(current), fence is not None))
    return segments


def _code_html(block: str) -> str:
    """A fenced block: the fence lines dimmed, the code escaped; every character kept."""
    lines = block.splitlines(keepends=True)
    first, rest = lines[0], lines[1:]
    last = ""
    if rest and _CLOSING.fullmatch(rest[-1]):
        last, rest = rest[-1], rest[:-1]
    fence = f'<span class="ls-fence">{html.escape(first)}</span>'
    closing = f'<span class="ls-fence">{html.escape(last)}</span>' if last else ""
    return f'<code class="ls-code">{fence}{html.escape("".join(rest))}{closing}</code>'


def text_html(text: str) -> str:
    """A message's text as HTML: escaped, code blocks set off; its textContent is ``text``."""
    return "".join(_code_html(piece) if is_code else html.escape(piece)
                   for piece, is_code in code_segments(text))


def message_html(role: str, text: str) -> str:
    """One message with its copy button. The role picks a fixed label and class; it is never
    written into the page itself."""
    label = ROLE_LABELS.get(role, "Other")
    kind = role if role in ROLE_LABELS else "other"
    return (f'<div class="ls-msg ls-{kind}" data-label="{label}">'
            f'<div class="ls-msg-head"><span>{label}</span>'
            '<button type="button" class="ls-copy" data-ls-copy="one" '
            'title="Copy this message as plain text">Copy</button></div>'
            f'<div class="ls-msg-text">{text_html(text)}</div></div>')


def chat_html(history: Sequence[Mapping[str, str]], pending: bool = False) -> str:
    """The whole conversation; ``pending``: an answer is on its way (no token yet)."""
    body = "".join(message_html(str(m.get("role", "")), str(m.get("content", "")))
                   for m in history)
    if not history:
        body = f'<div class="ls-chat-empty">{html.escape(EMPTY_TEXT)}</div>'
    if pending:
        body += '<div class="ls-pending">LocalSpec is answering…</div>'
    bar = ('<div class="ls-chat-bar"><span>Conversation (plain text: nothing in a message is '
           'interpreted)</span><button type="button" class="ls-copy" data-ls-copy="all" '
           'title="Copy the whole conversation as plain text">Copy all</button></div>')
    return (f'<div class="ls-chat">{bar}<div class="ls-chat-log"><div class="ls-chat-inner">'
            f"{body}</div></div></div>")


def notice_html(text: str) -> str:
    """A notice under the chat (a refusal, an error, "Stopped."), escaped: error messages
    quote settings, paths and model output."""
    if not text:
        return ""
    kind = "ls-error" if text.startswith("⚠") else "ls-info"
    return f'<div class="ls-notice {kind}">{html.escape(text)}</div>'
