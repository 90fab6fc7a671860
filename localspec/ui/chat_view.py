"""The conversation as HTML that cannot fetch or run anything: answers rendered as Markdown,
every message also kept verbatim, and its source kept for Copy.

Why not ``gr.Chatbot``: in Gradio 6.31 it renders every message as Markdown/HTML of its own
making (an image in an answer is fetched: the answer can leak the conversation to any server),
and its options cannot fix that without breaking something else. ``render_markdown=False``
still hands the text to the browser as HTML (``<b>`` turns bold, ``<img>`` loads);
``allow_tags`` escapes only the tags it is given (``i<n`` in code then swallows the rest of the
answer); escaping the text ourselves makes its copy buttons copy ``&lt;b&gt;``, since they copy
the stored value.

So the chat is a ``gr.HTML`` written here. Each message carries two views: ``.ls-msg-md``, its
Markdown rendered by ``localspec.ui.markdown`` (links only to http(s)/mailto and only on click,
images as links, raw HTML as text, code highlighted by class), and ``.ls-msg-text``, every
character through ``html.escape`` with whitespace kept by CSS (``pre-wrap``) and fenced code
set off in monospace, fences included, so that its ``textContent`` is exactly what was said.
Which view shows is CSS over two attributes of the ``#ls-chat`` element, set in the browser by
the page's checkboxes (``toggle_js``): answers show rendered unless ``data-ls-raw`` is set; the
user's own messages show verbatim (what was typed, ``__init__`` and ``2*3*4`` included) unless
``data-ls-md-mine`` is set. Toggling needs no round trip and holds while an answer streams.

Copy copies the source, never the rendered text: each message holds it in a ``data-ls-source``
attribute (escaped, carriage returns as ``&#13;`` so the HTML parser keeps them), and a code
block's Copy copies its code's ``textContent``, which is exactly the code. An attribute value
is text to the browser: it cannot load or run anything. While an answer streams, only its last
message is rendered in streaming mode (``render_markdown(streaming=True)``: half-typed markup
is held back rather than shown and reshaped). Conversation state lives in a ``gr.State`` of
plain-text messages; this HTML is only its view. No Gradio here: pure functions, tested
without a browser.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

from localspec.ui.markdown import CLOSING_FENCE, MARKDOWN_CSS, code_segments, render_markdown

__all__ = ["CHAT_CSS", "CHAT_JS", "chat_html", "code_segments", "message_html", "notice_html",
           "text_html", "toggle_js"]

ROLE_LABELS = {"user": "You", "assistant": "LocalSpec"}
EMPTY_TEXT = "No messages yet. Enter sends; Shift+Enter starts a new line."
RAW_ATTRIBUTE = "data-ls-raw"  # on #ls-chat: every message verbatim
MARKDOWN_MINE_ATTRIBUTE = "data-ls-md-mine"  # on #ls-chat: the user's messages rendered too

CHAT_CSS = """
#ls-chat .ls-chat { border: 1px solid var(--border-color-primary); border-radius: 8px; }
#ls-chat .ls-chat-bar { display: flex; justify-content: space-between; align-items: center;
  padding: 4px 8px; font-size: 0.85em; border-bottom: 1px solid var(--border-color-primary); }
#ls-chat .ls-chat-log { height: max(360px, 55vh); overflow-y: auto; display: flex;
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
#ls-chat .ls-msg-md { display: none; }
#ls-chat:not([data-ls-raw]) .ls-assistant > .ls-msg-md,
#ls-chat[data-ls-md-mine]:not([data-ls-raw]) .ls-user > .ls-msg-md { display: block; }
#ls-chat:not([data-ls-raw]) .ls-assistant > .ls-msg-text,
#ls-chat[data-ls-md-mine]:not([data-ls-raw]) .ls-user > .ls-msg-text { display: none; }
""" + MARKDOWN_CSS

# Runs once when the page loads (gr.HTML's ``js_on_load``; ``element`` is the component). One
# listener for every copy button, present and future: the HTML is re-rendered as the answer
# streams. A message's button copies its source (``data-ls-source``), a code block's its code.
CHAT_JS = """
const sourceOf = (message) => message.dataset.lsSource;
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
    text = messages.map((m) => m.dataset.label + ':\\n' + sourceOf(m)).join('\\n\\n');
  } else if (button.dataset.lsCopy === 'code') {
    text = button.closest('.ls-codeblock').querySelector('code').textContent;
  } else {
    text = sourceOf(button.closest('.ls-msg'));
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


def toggle_js(attribute: str) -> str:
    """A checkbox's client-side ``change`` handler: sets ``attribute`` (``RAW_ATTRIBUTE`` or
    ``MARKDOWN_MINE_ATTRIBUTE``) on ``#ls-chat`` while ticked; the chat's CSS does the rest."""
    return ("(on) => { const chat = document.getElementById('ls-chat'); "
            f"if (chat) chat.toggleAttribute('{attribute}', Boolean(on)); return []; }}")


def _code_html(block: str) -> str:
    """A fenced block: the fence lines dimmed, the code escaped; every character kept."""
    lines = block.splitlines(keepends=True)
    first, rest = lines[0], lines[1:]
    last = ""
    if rest and CLOSING_FENCE.fullmatch(rest[-1]):
        last, rest = rest[-1], rest[:-1]
    fence = f'<span class="ls-fence">{html.escape(first)}</span>'
    closing = f'<span class="ls-fence">{html.escape(last)}</span>' if last else ""
    return f'<code class="ls-code">{fence}{html.escape("".join(rest))}{closing}</code>'


def text_html(text: str) -> str:
    """A message's text as HTML: escaped, code blocks set off; its textContent is ``text``."""
    return "".join(_code_html(piece) if is_code else html.escape(piece)
                   for piece, is_code in code_segments(text))


def source_attribute(text: str) -> str:
    """``text`` as an attribute value the browser reads back exactly (carriage returns too)."""
    return html.escape(text, quote=True).replace("\r", "&#13;")


def message_html(role: str, text: str, streaming: bool = False) -> str:
    """One message: its copy button, its source, its views (rendered, verbatim); ``streaming``:
    the text is an answer still coming. The role picks a fixed label and class; it is never
    written into the page itself."""
    label = ROLE_LABELS.get(role, "Other")
    kind = role if role in ROLE_LABELS else "other"
    rendered = ("" if kind == "other" else
                f'<div class="ls-msg-md">{render_markdown(text, streaming)}</div>')
    return (f'<div class="ls-msg ls-{kind}" data-label="{label}" '
            f'data-ls-source="{source_attribute(text)}">'
            f'<div class="ls-msg-head"><span>{label}</span>'
            '<button type="button" class="ls-copy" data-ls-copy="one" '
            'title="Copy this message as written">Copy</button></div>'
            f'{rendered}<div class="ls-msg-text">{text_html(text)}</div></div>')


def chat_html(history: Sequence[Mapping[str, str]], pending: bool = False,
              streaming: bool = False) -> str:
    """The whole conversation; ``pending``: an answer is on its way (no token yet);
    ``streaming``: the last message, if the assistant's, is an answer still coming."""
    last = len(history) - 1
    body = "".join(message_html(role := str(m.get("role", "")), str(m.get("content", "")),
                                streaming and i == last and role == "assistant")
                   for i, m in enumerate(history))
    if not history:
        body = f'<div class="ls-chat-empty">{html.escape(EMPTY_TEXT)}</div>'
    if pending:
        body += '<div class="ls-pending">LocalSpec is answering…</div>'
    bar = ('<div class="ls-chat-bar"><span>Conversation (nothing in a message can load or run '
           'anything)</span><button type="button" class="ls-copy" data-ls-copy="all" '
           'title="Copy the whole conversation as written">Copy all</button></div>')
    return (f'<div class="ls-chat">{bar}<div class="ls-chat-log"><div class="ls-chat-inner">'
            f"{body}</div></div></div>")


def notice_html(text: str) -> str:
    """A notice under the chat (a refusal, an error, "Stopped."), escaped: error messages
    quote settings, paths and model output."""
    if not text:
        return ""
    kind = "ls-error" if text.startswith("⚠") else "ls-info"
    return f'<div class="ls-notice {kind}">{html.escape(text)}</div>'
