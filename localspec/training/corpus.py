"""The text a draft head is trained on: documents, wrapped as the target will see them, cut
into fixed-length chunks, and a few held-out prompts to measure acceptance on.

Default corpus: the Python standard library's own sources, found with ``sysconfig``, so that
every machine that runs LocalSpec already has it (nothing to download; the Hub is often out of
reach here). Each function or method becomes one document: the user asks for it (its
docstring's first paragraph, or just its name) and the assistant answers with its source in a
fenced code block. Files are visited in an order fixed by a hash of their path, at most
``MAX_PER_FILE`` documents each, so that a small ``--tokens`` budget still spans many modules.

Why the chat template (``format = "chat"``, the default when the target has one): the app
always runs the target inside it, so the hidden states a head drafts from at run time follow a
system prompt, a user turn and the assistant marker. Features taken from bare source text
would be another distribution (no template tokens, no code fence, no request to answer).
``raw`` is for base models without a template, and feeds the text as it is.

User files (``--corpus PATH ...``): ``.py`` files are read like the standard library (functions
without a docstring are asked for by name); ``.txt``, ``.md`` and ``.rst`` files are cut at
blank lines into pieces of about ``TEXT_PIECE`` characters, each asked for as "the next part"
of its file; ``.jsonl`` files hold one request per line, ``{"prompt": ..., "answer": ...}``
(the answer may be left out with ``--answers target``, which has the target write it). Folders
are searched recursively; the name ``stdlib`` is the default corpus. Several sources are
interleaved document by document, so that a token budget takes from each of them. Each file
is read as any user's file (regular files only, bounded); together they may hold at most
``MAX_CORPUS_BYTES``, checked from their sizes before any is read. The target's own answers
to the same requests (self-distillation, ``--answers target``) are made in ``answers.py``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from localspec.config import MAX_CORPUS_BYTES
from localspec.errors import ConfigError, InputFileError
from localspec.files import read_user_text

logger = logging.getLogger(__name__)

MAX_PER_FILE = 8  # documents taken from one source file
MAX_SOURCE_CHARS = 6000  # longer functions are skipped (one would fill several chunks)
MAX_FILE_BYTES = 400_000  # generated tables (pydoc_data/topics.py) are skipped
TEXT_PIECE = 2000  # characters per piece of a text file
TEXT_SUFFIXES = (".txt", ".md", ".rst")
REQUESTS_SUFFIX = ".jsonl"  # one request (and its answer, if written) per line
STDLIB = "stdlib"  # the --corpus name of the default corpus
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__", "lib2to3", "turtledemo", "ensurepip", "pydoc_data",
                       "encodings"})
MIN_CHUNK = 16  # a chunk shorter than this teaches nothing
RAW_PROMPT = 48  # tokens of a held-out raw document given as its prompt
FORMATS = ("auto", "chat", "raw")


@dataclass(frozen=True)
class Document:
    """One training example: what the user asks (``prompt``) and the answer (``text``)."""

    name: str  # where it came from, for messages
    prompt: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Token chunks to train on and prompts held out from them."""

    chunks: list[list[int]]  # each of the same length, cut from the documents' tokens
    eval_prompts: list[list[int]]  # ready for the assistant's answer (chat) or a prefix (raw)
    documents: int  # documents read for training
    exhausted: bool  # the documents ran out before the token budget


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and generated tables left out), in an
    order fixed by a hash of their relative path: modules mixed, the same order every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: hashlib.sha256(
        p.relative_to(root).as_posix().encode()).hexdigest())


def _summary(docstring: str | None) -> str:
    """The first paragraph of a docstring on one line, at most 400 characters."""
    first = (docstring or "").strip().split("\n\n")[0]
    return " ".join(first.split())[:400]


def python_documents(name: str, source: str) -> Iterator[Document]:
    """Every function and method of ``source`` as a request and its fenced source; nothing
    for a file that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: NUL bytes
        return
    nodes = [(node, "") for node in tree.body]
    nodes += [(item, f"{node.name}.") for node in tree.body if isinstance(node, ast.ClassDef)
              for item in node.body]
    taken = 0
    for node, owner in nodes:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or taken >= MAX_PER_FILE:
            continue
        segment = ast.get_source_segment(source, node)
        if not segment or len(segment) > MAX_SOURCE_CHARS:
            continue
        code = textwrap.dedent(" " * node.col_offset + segment)
        summary = _summary(ast.get_docstring(node))
        kind = "method" if owner else "function"
        ask = f"Write the Python {kind} `{owner}{node.name}`"
        prompt = f"{ask}: {summary}" if summary else f"{ask}."
        yield Document(f"{name}:{owner}{node.name}", prompt, f"```python\n{code}\n```")
        taken += 1


def text_documents(name: str, text: str) -> Iterator[Document]:
    """A text file cut at blank lines into pieces of about ``TEXT_PIECE`` characters."""
    piece: list[str] = []
    for paragraph in text.split("\n\n"):
        piece.append(paragraph)
        if sum(len(p) for p in piece) >= TEXT_PIECE:
            yield Document(name, f"Write the next part of {Path(name).name}.", "\n\n".join(piece))
            piece = []
    if "".join(piece).strip():
        yield Document(name, f"Write the next part of {Path(name).name}.", "\n\n".join(piece))


def default_documents() -> Iterator[Document]:
    """The standard library, file by file, read lazily (a small budget reads few files)."""
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            logger.info("corpus: skipping %s: %s", path, exc)
            continue
        if len(source) <= MAX_FILE_BYTES:
            yield from python_documents(path.name, source)


def request_documents(name: str, text: str) -> Iterator[Document]:
    """One request per line of a ``.jsonl`` file: ``{"prompt": str, "answer": str}``, the answer
    optional (empty: the target writes it); InputFileError names a line that is not one."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFileError(f"{name}, line {number}: not JSON ({exc.msg})") from exc
        prompt = row.get("prompt") if isinstance(row, dict) else None
        answer = row.get("answer", "") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(answer, str):
            raise InputFileError(f'{name}, line {number}: expected {{"prompt": "...", '
                                 f'"answer": "..."}} (the answer may be left out)')
        yield Document(f"{name}:{number}", prompt, answer)


def _files_of(name: str) -> list[Path]:
    """The file named (whatever it is: reading refuses what is not a regular file) or the
    files with a known suffix under the folder named; InputFileError when it is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            return sorted(p for p in path.rglob("*") if p.is_file()
                          and p.suffix in (".py", REQUESTS_SUFFIX, *TEXT_SUFFIXES))
        except OSError as exc:  # something under it that cannot be listed
            raise InputFileError(f"--corpus {name}: cannot read {exc.filename or name}: "
                                 f"{exc.strerror or exc}") from exc
    if os.path.lexists(path):
        return [path]
    raise InputFileError(f"--corpus {name}: no such file or folder")


def _read_source(name: str, answered: bool) -> list[Document]:
    """The documents of one ``--corpus`` argument (a file or a folder); with ``answered``,
    InputFileError for a request without its answer."""
    documents: list[Document] = []
    for path in _files_of(name):
        text = read_user_text(str(path), "corpus file")
        if path.suffix == ".py":
            documents += python_documents(str(path), text)
        elif path.suffix == REQUESTS_SUFFIX:
            requests = list(request_documents(str(path), text))
            missing = next((d.name for d in requests if answered and not d.text), None)
            if missing:
                raise InputFileError(f"{missing}: a request without an \"answer\": write "
                                     "one, or let the target answer with --answers target")
            documents += requests
        else:
            documents += text_documents(str(path), text)
    return documents


def user_documents(paths: list[str], answered: bool = True) -> Iterable[Document]:
    """The documents of the user's sources, interleaved one by one (``stdlib`` read lazily,
    the files read now: bad input is found before any model loads); InputFileError for a
    missing or non-UTF-8 file, more than ``MAX_CORPUS_BYTES`` in all, no text at all, or (with
    ``answered``: the written answers are trained on) a request without its answer."""
    files = [p for name in paths if name != STDLIB for p in _files_of(name)]
    try:
        total = sum(p.stat().st_size for p in files if p.is_file())
    except OSError as exc:
        raise InputFileError(f"--corpus {' '.join(paths)}: cannot read {exc.filename}: "
                             f"{exc.strerror or exc}") from exc
    if total > MAX_CORPUS_BYTES:
        raise InputFileError(f"--corpus {' '.join(paths)}: its files hold {total:,} bytes, more "
                             f"than the {MAX_CORPUS_BYTES:,} bytes a corpus may hold; name "
                             "fewer files or folders")
    sources: list[Iterable[Document]] = [default_documents() if name == STDLIB
                                         else _read_source(name, answered) for name in paths]
    if not any(isinstance(s, Iterator) or s for s in sources):
        raise InputFileError(f"--corpus {' '.join(paths)}: no text to train on (looked for "
                             f"functions in .py files, requests in {REQUESTS_SUFFIX} files and "
                             f"text in {', '.join(TEXT_SUFFIXES)} files)")
    if len(sources) == 1:
        return sources[0]
    gap = object()
    return (d for d in chain.from_iterable(zip_longest(*sources, fillvalue=gap)) if d is not gap)


def encoders(tokenizer: PreTrainedTokenizerBase, fmt: str
             ) -> tuple[Callable[[Document], list[int]], Callable[[Document], list[int]]]:
    """(document -> training tokens, document -> held-out prompt tokens) for ``fmt``: "chat"
    wraps the request and the answer in the target's chat template, as the app does; "raw"
    feeds the text alone (each document ends with the end-of-sequence token, if any)."""
    if fmt == "chat":
        def chat(messages: list[dict[str, str]], prompt: bool) -> list[int]:
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=prompt)
            except TemplateError as exc:
                raise ConfigError(f"the target's chat template refused a training document: "
                                  f"{exc}; use --format raw") from exc
            return tokenizer.encode(text, add_special_tokens=False)

        return (lambda d: chat([{"role": "user", "content": d.prompt},
                                {"role": "assistant", "content": d.text}], False),
                lambda d: chat([{"role": "user", "content": d.prompt}], True))
    end = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return (lambda d: [*tokenizer.encode(d.text), *end],
            lambda d: tokenizer.encode(d.text)[:RAW_PROMPT])


def build_corpus(documents: Iterable[Document], encode: Callable[[Document], list[int]],
                 prompt_ids: Callable[[Document], list[int]], tokens: int, seq_len: int,
                 eval_prompts: int) -> Corpus:
    """Hold out the first ``eval_prompts`` documents (when more follow), then encode
    documents until ``tokens`` tokens, cut into chunks of ``seq_len`` (shorter when the
    corpus holds less). InputFileError when too little text is left to train on."""
    stream: list[int] = []
    held: list[Document] = []
    read = 0
    exhausted = True
    for document in documents:
        if len(held) < eval_prompts:
            held.append(document)
            continue
        stream += encode(document)
        read += 1
        if len(stream) >= tokens:
            exhausted = False
            break
    if read == 0 and held:  # too few documents to hold any out: train on them all
        stream = [t for d in held for t in encode(d)][:tokens]
        read, held = len(held), []
    stream = stream[:tokens]
    length = min(seq_len, len(stream))
    if length < MIN_CHUNK:
        raise InputFileError(f"the corpus is too small: {len(stream)} tokens to train on "
                             f"(need at least {MIN_CHUNK}); give more text with --corpus")
    chunks = [stream[i:i + length] for i in range(0, len(stream) - length + 1, length)]
    return Corpus(chunks, [prompt_ids(d) for d in held], read, exhausted)
