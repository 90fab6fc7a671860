"""Markdown to safe HTML (``localspec.ui.markdown``), without a browser: the injection set makes
no element that could load or run anything (and the checker itself catches one that does);
ordinary Markdown renders (headings, tables, lists, links, highlighted code); code keeps every
character; every streaming prefix of a long answer is well-formed HTML whose finished blocks
never change kind and whose code is a prefix of the final code."""

from __future__ import annotations

import random
from html.parser import HTMLParser

import pytest

from localspec.ui.markdown import (
    code_block_html,
    ends_in_open_fence,
    highlight_code,
    is_safe_url,
    render_markdown,
    streaming_source,
)

LEAK = "http://127.0.0.1:9"
INJECTIONS = [
    f"![x]({LEAK}/leak.png)",
    f'![x]({LEAK}/titled.png "t") text',
    f"![x][r]\n\n[r]: {LEAK}/ref.png",
    f"![x][]\n\n[x]: {LEAK}/collapsed.png",
    f'![x]\n\n[x]: <{LEAK}/shortcut.png> "t"',
    f'<img src="{LEAK}/img" onerror="alert(1)">',
    f"<IMG SRC={LEAK}/upper>",
    "<script>alert(1)</script>",
    f"<script src={LEAK}/s.js></script>",
    "<iframe src=//127.0.0.1:9/frame></iframe>",
    f"<svg><image href={LEAK}/svg /></svg><svg onload=alert(1)>",
    f"<style>body{{background:url({LEAK}/css)}}</style>",
    f'<div style="background:url({LEAK}/style)">x</div>',
    "[click](javascript:alert(1))",
    "[c](JaVaScRiPt:alert(1)) [c](java&#115;cript:alert(1)) [c](&#106;avascript:alert(1))",
    "[c](javascript&colon;alert(1)) [c](<javascript:alert(1)>) [c](\tjavascript:alert(1))",
    "[d](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "![d](data:image/png;base64,iVBORw0KGgo=) ![s](data:image/svg+xml,<svg/onload=alert(1)>)",
    "[v](vbscript:msgbox(1)) [f](file:///etc/passwd) [ftp](ftp://127.0.0.1:9/f)",
    "<javascript:alert(1)> <data:text/html,x> <vbscript:x> <file:///etc/passwd>",
    f"<{LEAK}/autolink> <mailto:a@b.c> <a@b.c>",
    "[r]: javascript:alert(1)\n\n[x][r] ![y][r]",
    "[rel](/v1/models) [frag](#x) [proto](//127.0.0.1:9/p) [x]() ![y]() [w](http:///x)",
    f"{LEAK}/bare www.example.com",
    f'<a href="{LEAK}/a">a</a> <link rel=stylesheet href={LEAK}/l.css>',
    f"<object data={LEAK}/o></object><embed src={LEAK}/e><video poster={LEAK}/v></video>",
    f"<meta http-equiv=refresh content='0;url={LEAK}/m'><base href={LEAK}/>",
    f"<form action={LEAK}/f><input type=image src={LEAK}/i></form>",
    "&lt;img src=x&gt; &#60;script&#62; &amp;lt; &#x3C;iframe&#x3E;",
    f"```html\n<img src={LEAK}/code>\n```",
    '```" onmouseover="alert(1)\n</code></pre><img src=x>\n```',
    f"| a | <img src={LEAK}/cell> |\n|:-:|--:|\n| <script>x</script> | ![i]({LEAK}/t.png) |",
    f"[![i]({LEAK}/nested.png)](javascript:alert(1)) [![i]({LEAK}/n2.png)]({LEAK}/ok)",
    "<!-- comment --> <?php echo 1; ?> <![CDATA[x]]> <!DOCTYPE html>",
    "${1+1} {{x}} \"' onmouseover=alert(1) x='",
    f"> <img src={LEAK}/quote>\n> - ![l]({LEAK}/list.png)\n\n    <img src=indented>",
]
ALLOWED_TAGS = {"p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "s", "code",
                "pre", "blockquote", "ul", "ol", "li", "table", "thead", "tbody", "tr", "th",
                "td", "a", "span", "div", "button"}
VOID_TAGS = {"br", "hr"}
FREE_TEXT_ATTRIBUTES = {"title", "data-ls-source"}  # text the browser never loads or runs
FIXED_ATTRIBUTES = {"class", "href", "target", "rel", "type", "start", "data-ls-copy",
                    "data-label"}


class Parsed(HTMLParser):
    """A fragment's tags (with attributes), its elements with their depth and text content
    (as the browser's textContent has it), and its text; the nesting is checked."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.elements: list[list] = []  # [tag, attrs, depth, text]
        self.text: list[str] = []
        self.open: list[int] = []
        self.feed(page)
        self.close()
        assert self.open == [], f"unclosed {self.open} in {page!r}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self.elements.append([tag, dict(attrs), len(self.open), ""])
        if tag not in VOID_TAGS:
            self.open.append(len(self.elements) - 1)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        assert tag in VOID_TAGS, tag
        self.tags.append((tag, dict(attrs)))
        self.elements.append([tag, dict(attrs), len(self.open), ""])

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.elements[self.open[-1]][0] == tag, f"</{tag}> in {self.open}"
        self.open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        for index in self.open:
            self.elements[index][3] += data

    def handle_comment(self, data: str) -> None:
        raise AssertionError(f"a comment: {data!r}")

    def handle_decl(self, decl: str) -> None:
        raise AssertionError(f"a declaration: {decl!r}")

    def handle_pi(self, data: str) -> None:
        raise AssertionError(f"a processing instruction: {data!r}")

    def unknown_decl(self, data: str) -> None:
        raise AssertionError(f"a declaration: {data!r}")

    def texts(self, tag: str) -> list[str]:
        """The text of each ``tag`` element."""
        return [text for name, _, _, text in self.elements if name == tag]

    def blocks(self) -> list[str]:
        """The top-level elements, in order (a code block counts as one)."""
        return [name for name, _, depth, _ in self.elements if depth == 0]


def assert_safe(page: str) -> Parsed:
    """Well-formed, only the renderer's tags, no attribute that loads, runs or styles: links
    only to http(s) and mailto, opened in a new tab without opener or referrer."""
    parsed = Parsed(page)
    for tag, attrs in parsed.tags:
        assert tag in ALLOWED_TAGS, (tag, attrs)
        for name, value in attrs.items():
            assert name in FIXED_ATTRIBUTES | FREE_TEXT_ATTRIBUTES, (tag, name, value)
            if name not in FREE_TEXT_ATTRIBUTES | {"href"}:  # an href is judged by its scheme
                lowered = (value or "").lower()
                assert "url(" not in lowered and "javascript:" not in lowered, (name, value)
        if "href" in attrs:
            assert tag == "a" and is_safe_url(attrs["href"] or ""), attrs
            assert attrs["href"].startswith(("http://", "https://", "mailto:")), attrs
            assert attrs.get("target") == "_blank", attrs
            assert set((attrs.get("rel") or "").split()) >= {"noopener", "noreferrer"}, attrs
        if "start" in attrs:
            assert tag == "ol" and (attrs["start"] or "").isdigit(), attrs
    return parsed


@pytest.mark.parametrize("bad", [
    '<img src="x">', '<a href="javascript:alert(1)" target="_blank" rel="noopener noreferrer">',
    '<a href="http://e/">x</a>', '<p style="color:red">x</p>', "<p><b>x</p>", "<p>x",
    '<span class="url(http://e/)">x</span>', "<svg></svg>", "<!-- x -->"])
def test_the_checker_catches_what_it_must(bad: str) -> None:
    """A negative control: each of these would pass a checker that checks nothing."""
    with pytest.raises(AssertionError):
        assert_safe(bad)


@pytest.mark.parametrize("text", INJECTIONS)
def test_injections_make_nothing_that_loads_or_runs(text: str) -> None:
    page = render_markdown(text)
    parsed = assert_safe(page)
    assert "<img" not in page.lower() and "<script" not in page.lower()
    hrefs = [attrs["href"] for _, attrs in parsed.tags if "href" in attrs]
    assert all(h.startswith(("http://127.0.0.1:9/", "mailto:a@b.c")) for h in hrefs), hrefs


def test_random_markdown_renders_safe_and_well_formed() -> None:
    """Markup pieces and the injections shaken together, rendered finished and streaming."""
    pieces = ["> ", "- ", "1. ", "  ", "    ", "\n", "\n\n", "|", "---", "```", "~~~", "`",
              "**", "_", "[", "](", ")", "!", "<", ">", "&", "#", "http://e/x", "javascript:",
              "\\", '"', "a", "\t", "=", "&#0;", "\x00", "\r", "\u2028", *INJECTIONS]
    rng = random.Random(21)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 60)))
        for streaming in (False, True):
            assert_safe(render_markdown(text, streaming))
    assert_safe(render_markdown("> " * 200 + "- " * 200 + "x"))  # nesting beyond the limit


def test_unsafe_links_stay_the_characters_written() -> None:
    text = "[click](javascript:alert(1)) <javascript:alert(1)> [d](data:text/html,x)"
    assert "".join(assert_safe(render_markdown(text)).text).strip() == text
    assert "".join(Parsed(render_markdown("[x]() ![y]()")).text).strip() == "x 🖼 y"
    raw = "<script>alert(1)</script> <img src=x>"
    assert "".join(Parsed(render_markdown(raw)).text).strip() == raw  # raw HTML is text


def test_images_are_links_labelled_with_alt_and_host() -> None:
    page = render_markdown(f"![a chart]({LEAK}/c.png) and ![r][ref]\n\n[ref]: https://ex.org/i")
    links = [(attrs, text) for tag, attrs, _, text in Parsed(page).elements if tag == "a"]
    assert [text for _, text in links] == ["🖼 a chart (127.0.0.1)", "🖼 r (ex.org)"]
    assert [a["href"] for a, _ in links] == [f"{LEAK}/c.png", "https://ex.org/i"]
    assert all("ls-image" in a["class"] and "not loaded" in a["title"] for a, _ in links)
    nested = assert_safe(render_markdown(f"[![logo]({LEAK}/l.png)](https://ex.org/)"))
    assert [t for t, a in nested.tags if t == "a"] == ["a"]  # the image inside: text only
    assert "🖼 logo (127.0.0.1)" in "".join(nested.text)


def test_ordinary_markdown_renders() -> None:
    text = ("# Title\n\n## Part *one*\n\nSome **bold**, _em_, ~~gone~~ and `x < 1`.\nNext line.\n"
            "\n- a\n- b\n  1. inner\n\n> quoted\n\n| name | n |\n|:-----|--:|\n| a | 1 |\n"
            "| b | 2 |\n\n"
            "See [docs](https://example.org/d \"the docs\") or <https://example.org>.\n\n"
            "```python\ndef f(x):\n    return x < 1  # small\n```\n\n---\n")
    page = render_markdown(text)
    parsed = assert_safe(page)
    tags = [tag for tag, _ in parsed.tags]
    for tag in ("h1", "h2", "em", "strong", "s", "ul", "ol", "li", "blockquote", "table", "th",
                "td", "a", "pre", "hr", "br"):
        assert tag in tags, tag
    assert "<h1>Title</h1>" in page and "<code>x &lt; 1</code>" in page
    cells = [attrs.get("class") for tag, attrs in parsed.tags if tag in ("th", "td")]
    assert cells == ["ls-align-left", "ls-align-right"] * 3  # alignment by class, not style
    link = next(attrs for tag, attrs in parsed.tags if tag == "a")
    assert link == {"href": "https://example.org/d", "target": "_blank",
                    "rel": "noopener noreferrer nofollow", "title": "the docs"}
    classes = {attrs.get("class") for tag, attrs in parsed.tags if tag == "span"}
    assert {"k", "nf", "mi", "c1"} <= classes  # pygments: keyword, function, number, comment
    assert '<span class="ls-code-lang">python</span>' in page
    assert page.count('data-ls-copy="code"') == 1


def test_unknown_languages_and_indented_code_stay_plain() -> None:
    page = render_markdown("```no-such-language\na <b> c\n```\n\n    indented <i>\n")
    assert_safe(page)
    assert "a &lt;b&gt; c\n</code>" in page and "indented &lt;i&gt;\n</code>" in page
    assert page.count('data-ls-copy="code"') == 2 and "ls-code-lang\">code<" in page


def _code_texts(page: str) -> list[str]:
    """The text of each code block (<pre><code>), as the browser's textContent has it."""
    return Parsed(page).texts("pre")


def _fuzz_code(rng: random.Random) -> str:
    pieces = ["    ", "\t", " ", "\n", "\n\n", "<", ">", "&", "&amp;", '"', "'", "x", "if",
              "def", "return", "#", "//", "/*", "*/", "(", ")", "{", "}", "\\", "é", "€", "😀",
              "\ufeff", "  \n", "1.5", "$x", "`"]
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 60)))


@pytest.mark.parametrize("lang", ["python", "c", "js", "rust", "bash", "html", "json", "diff",
                                  "", "no-such-language"])
def test_code_keeps_every_character(lang: str) -> None:
    """Whitespace, indentation, tabs, markup characters and a leading byte-order mark: the code
    block's text is its code exactly (what its Copy button copies)."""
    rng = random.Random(lang)
    for _ in range(60):
        code = _fuzz_code(rng)
        assert _code_texts(code_block_html(code, lang)) == [code]
        assert "".join(Parsed(highlight_code(code, lang)).text) == code
        fenced = f"~~~~{lang}\n{code}\n~~~~\n"
        assert _code_texts(render_markdown(fenced)) == [code + "\n"]


def test_an_open_fence_renders_as_a_closed_block_to_the_end() -> None:
    text = "Here:\n\n```python\ndef f(x):\n    if x < 1:\n        return x"
    assert ends_in_open_fence(text) and not ends_in_open_fence(text + "\n```\n")
    for streaming in (False, True):
        page = render_markdown(text, streaming)
        assert_safe(page)
        assert _code_texts(page) == ["def f(x):\n    if x < 1:\n        return x"]
        assert 'data-ls-copy="code"' in page


LONG_ANSWER = """# Palindromes

A *palindrome* reads the same **both ways**. Steps:

1. Lower-case the text.
2. Drop what is not a letter:
   - spaces
   - punctuation

| input | palindrome? | note |
|:------|:-----------:|-----:|
| Racecar | yes | case |
| A man, a plan | yes | spaces |
| abc | no | |

```python
def is_palindrome(text: str) -> bool:
    \"\"\"Whether text reads the same both ways.\"\"\"
    letters = [c.lower() for c in text if c.isalnum()]
\treturn letters == letters[::-1]  # <- a tab
```

> Note: `str.isalnum` keeps digits too.

Setext heading
--------------

~~~bash
$ python3 -c 'print(1 < 2 && 3)'
~~~

See [the docs](https://docs.python.org/3/) or ![a diagram](https://example.org/d.png).
"""


def test_every_streaming_prefix_is_well_formed_and_never_reshapes_finished_blocks() -> None:
    final = render_markdown(LONG_ANSWER)
    final_blocks, final_code = Parsed(final).blocks(), _code_texts(final)
    assert final_blocks == ["h1", "p", "ol", "table", "div", "blockquote", "h2", "div", "p"]
    assert final_code[0].endswith("\treturn letters == letters[::-1]  # <- a tab\n")
    for end in range(len(LONG_ANSWER) + 1):
        prefix = LONG_ANSWER[:end]
        page = render_markdown(prefix, streaming=True)
        parsed = assert_safe(page)
        blocks = parsed.blocks()
        # Every block but the last is final already; the last one is, or is a paragraph
        # still growing (into a list item or a setext heading, as its next line decides).
        assert blocks[:-1] == final_blocks[:max(len(blocks) - 1, 0)], (prefix, blocks)
        assert not blocks or blocks[-1] in (final_blocks[len(blocks) - 1], "p"), (prefix, blocks)
        assert not any(p.startswith("|") for p in parsed.texts("p")), prefix  # no table as text
        for shown, whole in zip(_code_texts(page), final_code, strict=False):
            assert whole.startswith(shown), (prefix, shown)
    assert render_markdown(LONG_ANSWER, streaming=True) == final


@pytest.mark.parametrize(("text", "shown"), [
    ("Title\n-", "Title\n"),  # a setext underline being typed: not yet a heading
    ("Intro\n| a | b |", "Intro\n"),  # a table header waiting for its delimiter row
    ("| a | b |\n|--", ""),
    ("| a | b |\n|---|---|\n", "| a | b |\n|---|---|\n"),  # the table is decided
    ("| a | b |\n|---|---|\n| 1 | tw", "| a | b |\n|---|---|\n| 1 | tw"),
    ("Done.\n\n```py", "Done.\n\n```py"),  # a fence with its language on the way
    ("Done.\n\n``", "Done.\n\n"),
    ("```\n| x |", "```\n| x |"),  # inside code, a pipe is code
    ("- one\n- ", "- one\n"),
    ("Steps:\n1.", "Steps:\n"),
])
def test_streaming_holds_back_what_the_next_characters_could_reshape(text: str,
                                                                     shown: str) -> None:
    assert streaming_source(text) == shown
    assert text.startswith(streaming_source(text))


@pytest.mark.parametrize("url", ["http://e.org", "https://e.org/x?y#z", "mailto:a@b.c",
                                 "HTTPS://E.ORG/"])
def test_safe_urls(url: str) -> None:
    assert is_safe_url(url)


@pytest.mark.parametrize("url", ["javascript:alert(1)", "data:text/html,x", "vbscript:x",
                                 "file:///etc/passwd", "/relative", "#frag", "//e.org/x",
                                 "http:e.org", "http:///x", "http://[bad", "mailto:", "",
                                 " http://e.org", "\x01http://e.org", "ftp://e.org"])
def test_unsafe_urls(url: str) -> None:
    assert not is_safe_url(url)
