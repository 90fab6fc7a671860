"""A message's Markdown as safe HTML: pure functions, source text in, HTML that cannot fetch out.

The parser is ``markdown-it-py`` (CommonMark, plus tables and strikethrough, single line breaks
kept as ``<br>``: a chat answer means its line breaks) with raw HTML off, so ``<img>``,
``<script>`` or ``<iframe>`` in a message are text. What it would still turn into an element that
loads or runs something is taken in hand here:

- Links: only ``http(s)://`` with a host, and ``mailto:``. Anything else (``javascript:``,
  ``data:``, ``vbscript:``, ``file:``, relative paths) fails link validation, so it stays the
  characters that were written. A link opens only on click, in a new tab, with
  ``rel="noopener noreferrer nofollow"``. Bare URLs are not turned into links (no linkify).
- Images are never loaded: ``![alt](url)``, reference-style ones included, is a link labelled
  with its alt text and the URL's host; inside a link it is that label as text.
- Tables align their cells by class, not ``style``: no attribute carries CSS, so ``url()``
  cannot appear in one. Code is highlighted by ``pygments`` (by the fence's language; unknown
  ones stay plain) into spans with classes; its stylesheet (``MARKDOWN_CSS``) is generated here
  and served with the page's CSS, never fetched.

Code keeps every character: a fenced block's ``textContent`` is exactly its code (what its Copy
button copies). While an answer streams (``streaming=True``), what is not yet decided is held
back rather than shown and then reshaped: an unfinished last line of markup characters only (a
setext underline, a table's delimiter row, a list marker or fence being typed), and a lone table
header row until its delimiter row arrives. An unclosed fence renders as a closed one, to the
end. Nothing here knows about Gradio.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from markdown_it import MarkdownIt
from markdown_it.common.utils import unescapeAll
from markdown_it.token import Token
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.token import STANDARD_TYPES, _TokenType
from pygments.util import ClassNotFound

LINK_REL = "noopener noreferrer nofollow"
HIGHLIGHT_CLASS = "ls-hl"
LIGHT_STYLE, DARK_STYLE = "default", "github-dark"
RENDER_CACHE_SIZE = 256  # finished messages whose HTML is kept (see _render_finished)
# A fence opens a code block: up to 3 spaces, then 3+ backticks or tildes (CommonMark).
OPENING_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
CLOSING_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*(\r\n|\r|\n)?")
# An unfinished last line made of markup characters only: its meaning depends on what follows.
_MARKUP_ONLY = re.compile(r"[-=|:*_`~+#>.\d \t]*")
_TABLE_ROW = re.compile(r" {0,3}\|")
_ALIGN = re.compile(r"text-align:(left|center|right)")


def _scan(text: str) -> tuple[list[tuple[str, bool]], bool]:
    """``code_segments`` of ``text``, and whether its last fence is still open."""
    segments: list[tuple[str, bool]] = []
    current: list[str] = []
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        if fence is None:
            opening = OPENING_FENCE.match(line)
            if opening is not None:
                if current:
                    segments.append(("".join(current), False))
                current, fence = [line], opening.group(1)
            else:
                current.append(line)
            continue
        current.append(line)
        closing = CLOSING_FENCE.fullmatch(line)
        if (closing is not None and closing.group(1)[0] == fence[0]
                and len(closing.group(1)) >= len(fence)):
            segments.append(("".join(current), True))
            current, fence = [], None
    if current:
        segments.append(("".join(current), fence is not None))
    return segments, fence is not None


def code_segments(text: str) -> list[tuple[str, bool]]:
    """``text`` cut into (piece, is_code): fenced code blocks, fence lines included, and the
    prose between them. The pieces join to exactly ``text`` (an unclosed fence runs to the
    end, as in CommonMark)."""
    return _scan(text)[0]


def ends_in_open_fence(text: str) -> bool:
    """Whether ``text`` ends inside a fenced code block that has not been closed."""
    return _scan(text)[1]


def is_safe_url(url: str) -> bool:
    """Whether ``url`` may be a link: ``http(s)://`` with a host, or ``mailto:``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # a malformed host ("http://[x")
        return False
    if parts.scheme in ("http", "https"):
        return url.lower().startswith(f"{parts.scheme}://") and bool(host)
    return parts.scheme == "mailto" and len(url) > len("mailto:")


def url_host(url: str) -> str:
    """The host part of a URL ("" if none), shown beside an image's alt text."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def streaming_source(text: str) -> str:
    """The part of an answer still streaming that is rendered: ``text`` without what the next
    characters could reshape (see the module doc). Holding back never removes a character
    from the middle: the result is a prefix of ``text``."""
    head, newline, tail = text.rpartition("\n")
    if _MARKUP_ONLY.fullmatch(tail):
        text = head + newline
    if ends_in_open_fence(text):
        return text
    lines = text.split("\n")
    last = len(lines) - 1 if lines[-1].strip() else len(lines) - 2
    if last >= 0 and _TABLE_ROW.match(lines[last]) and (
            last == 0 or not _TABLE_ROW.match(lines[last - 1])):
        return "\n".join([*lines[:last], ""]) if last else ""
    return text


def _lexer(lang: str) -> Lexer | None:
    """The pygments lexer for a fence's language name, keeping the code as it is."""
    if not lang:
        return None
    try:
        return get_lexer_by_name(lang, stripnl=False, stripall=False, ensurenl=False, tabsize=0)
    except ClassNotFound:
        return None


def _css_class(ttype: _TokenType) -> str:
    """Pygments' short class for a token type (that of its nearest standard ancestor)."""
    while ttype not in STANDARD_TYPES:
        ttype = ttype.parent
    return STANDARD_TYPES[ttype]


def highlight_code(code: str, lang: str) -> str:
    """``code`` as escaped HTML, in spans with pygments' classes when ``lang`` is known; its
    text is exactly ``code``. The spans are written here (pygments' HtmlFormatter ends the
    last line with a newline the code may not have; its lexers drop a leading byte-order
    mark, which is kept)."""
    lexer = _lexer(lang)
    if lexer is None:
        return html.escape(code)
    body = code.lstrip("\ufeff")
    parts = [html.escape(code[:len(code) - len(body)])]
    for ttype, value in lexer.get_tokens(body):
        css, text = _css_class(ttype), html.escape(value)
        parts.append(f'<span class="{css}">{text}</span>' if css else text)
    return "".join(parts)


def code_block_html(code: str, lang: str) -> str:
    """A code block: its language, a Copy button (it copies the code's text), the code."""
    label = html.escape(lang) if lang else "code"
    return ('<div class="ls-codeblock"><div class="ls-code-head">'
            f'<span class="ls-code-lang">{label}</span><button type="button" class="ls-copy" '
            'data-ls-copy="code" title="Copy this code block">Copy</button></div>'
            f'<pre class="{HIGHLIGHT_CLASS}"><code>{highlight_code(code, lang)}</code></pre>'
            "</div>\n")


def _attr(value: str) -> str:
    return html.escape(value, quote=True)


def _fence(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    info = unescapeAll(tokens[idx].info).strip()
    return code_block_html(tokens[idx].content, info.split()[0] if info else "")


def _code_block(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    return code_block_html(tokens[idx].content, "")


def _link_open(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    token = tokens[idx]
    title = str(token.attrGet("title") or "")
    return (f'<a href="{_attr(str(token.attrGet("href")))}" target="_blank" rel="{LINK_REL}"'
            + (f' title="{_attr(title)}"' if title else "") + ">")


def _image(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    """An image as a link to it, never loaded; plain text when unsafe or inside a link."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    alt = self.renderInlineAsText(token.children or [], options, env) or "image"
    host = url_host(src)
    label = html.escape(f"🖼 {alt}" + (f" ({host})" if host else ""))
    opened = sum(1 if t.type == "link_open" else -1 if t.type == "link_close" else 0
                 for t in tokens[:idx])
    if opened > 0 or not is_safe_url(src):
        return f'<span class="ls-image">{label}</span>'
    return (f'<a class="ls-image" href="{_attr(src)}" target="_blank" rel="{LINK_REL}" '
            f'title="{_attr("image, not loaded: " + src)}">{label}</a>')


def _parser() -> MarkdownIt:
    """A parser for one rendering (creating one costs well under a millisecond)."""
    md = MarkdownIt("commonmark", {"html": False, "breaks": True})
    md.enable(["table", "strikethrough"])
    md.validateLink = is_safe_url  # type: ignore[method-assign]
    for name, rule in (("fence", _fence), ("code_block", _code_block),
                       ("link_open", _link_open), ("image", _image)):
        md.add_render_rule(name, rule)
    return md


def _neutralise(tokens: list[Token]) -> None:
    """Table alignment as a class instead of ``style``; a link whose URL is not safe (an
    empty ``[x]()`` passes the parser) loses its ``<a>`` and keeps its text."""
    for token in tokens:
        if token.type in ("th_open", "td_open") and token.attrs:
            align = _ALIGN.fullmatch(str(token.attrGet("style") or ""))
            token.attrs = {"class": f"ls-align-{align.group(1)}"} if align else {}
        if token.children:
            kept, safe = [], []
            for child in token.children:
                if child.type == "link_open":
                    safe.append(is_safe_url(str(child.attrGet("href") or "")))
                    if not safe[-1]:
                        continue
                elif child.type == "link_close" and safe and not safe.pop():
                    continue
                kept.append(child)
            token.children = kept


def render_markdown(text: str, streaming: bool = False) -> str:
    """``text`` (Markdown) as safe HTML. ``streaming``: the text is an answer still coming,
    rendered without what could still change shape (``streaming_source``)."""
    return _render(streaming_source(text)) if streaming else _render_finished(text)


@lru_cache(maxsize=RENDER_CACHE_SIZE)
def _render_finished(text: str) -> str:
    """``_render``, remembered: the whole conversation is rendered at every streamed update,
    and its finished messages need not be parsed again (an answer's growing prefixes are not
    kept)."""
    return _render(text)


def _render(text: str) -> str:
    md = _parser()
    env: dict[str, Any] = {}
    tokens = md.parse(text, env)
    _neutralise(tokens)
    return md.renderer.render(tokens, md.options, env)


def _pygments_css(scope: str, style: str) -> str:
    """Pygments' rules for ``style``, every one under ``scope`` (its line-number rules are
    global ``pre`` rules, so they are left out)."""
    formatter = HtmlFormatter(style=style)
    selector = f"{scope} .{HIGHLIGHT_CLASS}"
    return "\n".join([*formatter.get_background_style_defs(selector),
                      *formatter.get_token_style_defs(selector)]) + "\n"


MARKDOWN_CSS = (
    _pygments_css("#ls-chat", LIGHT_STYLE) + _pygments_css(".dark #ls-chat", DARK_STYLE) + """
#ls-chat .ls-msg-md { overflow-wrap: anywhere; }
#ls-chat .ls-msg-md > :first-child { margin-top: 0; }
#ls-chat .ls-msg-md > :last-child { margin-bottom: 0; }
#ls-chat .ls-msg-md p, #ls-chat .ls-msg-md ul, #ls-chat .ls-msg-md ol,
#ls-chat .ls-msg-md blockquote, #ls-chat .ls-msg-md table { margin: 0.4em 0; }
#ls-chat .ls-msg-md h1 { font-size: 1.4em; } #ls-chat .ls-msg-md h2 { font-size: 1.25em; }
#ls-chat .ls-msg-md h3 { font-size: 1.1em; }
#ls-chat .ls-msg-md h4, #ls-chat .ls-msg-md h5, #ls-chat .ls-msg-md h6 { font-size: 1em; }
#ls-chat .ls-msg-md :is(h1, h2, h3, h4, h5, h6) { margin: 0.6em 0 0.3em; font-weight: 600; }
#ls-chat .ls-msg-md ul, #ls-chat .ls-msg-md ol { padding-left: 1.6em; }
#ls-chat .ls-msg-md ul { list-style: disc; } #ls-chat .ls-msg-md ol { list-style: decimal; }
#ls-chat .ls-msg-md blockquote { border-left: 3px solid var(--border-color-primary);
  padding-left: 0.8em; opacity: 0.85; }
#ls-chat .ls-msg-md table { border-collapse: collapse; display: block; overflow-x: auto;
  width: max-content; max-width: 100%; border: none; padding: 0; }
#ls-chat .ls-msg-md th, #ls-chat .ls-msg-md td { border: 1px solid var(--border-color-primary);
  padding: 2px 8px; }
#ls-chat .ls-msg-md .ls-align-left { text-align: left; }
#ls-chat .ls-msg-md .ls-align-center { text-align: center; }
#ls-chat .ls-msg-md .ls-align-right { text-align: right; }
#ls-chat .ls-msg-md a { text-decoration: underline; padding: 0; }
#ls-chat .ls-msg-md :not(pre) > code { font-family: ui-monospace, SFMono-Regular, Menlo,
  monospace; font-size: 0.9em; padding: 0 3px; border-radius: 3px;
  background: rgba(127, 127, 127, 0.15); }
#ls-chat .ls-codeblock { margin: 0.5em 0; border: 1px solid var(--border-color-primary);
  border-radius: 6px; overflow: hidden; }
#ls-chat .ls-code-head { display: flex; justify-content: space-between; align-items: center;
  font-size: 0.75em; padding: 2px 6px; border-bottom: 1px solid var(--border-color-primary); }
#ls-chat .ls-codeblock pre { margin: 0; padding: 6px 8px; overflow-x: auto; white-space: pre;
  font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 0.9em; }
""")
