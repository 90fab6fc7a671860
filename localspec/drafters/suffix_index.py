"""Token sequences searched for the longest match of a context's tail: the suffix drafter's index.

SuffixDecoding (Oliaro et al., 2024; Snowflake Arctic Inference; vLLM's method "suffix") keeps
suffix trees over the current request and over earlier outputs, finds the longest suffix of the
context (up to a depth) that occurs in them, and drafts the continuations seen most often after
it. A pointer-based suffix tree in Python costs a dictionary per node, D nodes per token: far
too slow and large for millions of history tokens. This module answers the same questions with
flat numpy arrays:

``TokenIndex`` holds sequences one after another in one int32 buffer, separated by ``SEP``
(never a token, so no match or continuation crosses from one answer into the next). Positions
are found by their last three tokens: a sorted array of keys (token, token before, token before
that; 21 bits each) over the buffer's older part, searched with ``np.searchsorted``, and a plain
scan of the newest part (``fresh``), which is folded into the sorted part once it grows past
``fresh_tokens``. Of the candidates (at most ``max_candidates`` of each part, the most recent
first), the match length of each is measured at once, by comparing the ``depth`` tokens before
it with the context's tail in one gather; the longest win. The candidate cap bounds a query's
cost whatever the history's size; it can miss an old long match of a very common trigram (the
most recent occurrences are searched), never return a wrong one.

``AnswerHistory`` is the global index: earlier answers in a ``TokenIndex``, each after the last
``LEAD_TOKENS`` tokens of its prompt where they are known, at most ``cap_tokens`` tokens, the
oldest answers evicted first (at once from every query, from memory at the next compaction);
thread-safe, since answers finish on other threads than the ones that draft. Neither knows
models, tokenizers, files or the conversations' store: the pipeline fills the history, the
drafter reads it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from localspec.config import MAX_LOOKUP_NGRAM

SEP = -1  # between sequences, and past the end: never a token
KEY_BITS = 21
BOUNDARY = (1 << KEY_BITS) - 1  # in a key: no token there (a sequence's start)
MAX_TOKEN_ID = BOUNDARY - 1  # larger ids are never indexed (no vocabulary is this large)
MAX_DEPTH = MAX_LOOKUP_NGRAM  # the longest match measured, the deepest continuation read
MAX_CANDIDATES = 256  # occurrences measured per part of an index, the most recent first
FRESH_TOKENS = 65_536  # a history's newest tokens scanned, not sorted, up to this many
LEAD_TOKENS = 16  # the prompt's last tokens kept before an answer in the history


@dataclass(frozen=True)
class Match:
    """The longest earlier occurrences of a context's tail: its ``length`` in tokens and the
    tokens that followed each occurrence (``rows`` [occurrences, depth], ``SEP`` past the end
    of its sequence)."""

    length: int
    rows: np.ndarray  # [occurrences, depth] int32


NO_MATCH = Match(0, np.zeros((0, 0), dtype=np.int32))


def tail_of(context: Sequence[int], depth: int) -> np.ndarray:
    """The context's last ``depth`` tokens, last first, padded with -2 (matches nothing)."""
    tail = np.full(depth, -2, dtype=np.int64)
    last = list(context[-depth:])[::-1]
    tail[: len(last)] = last
    return tail


class TokenIndex:
    """Sequences of token ids, searchable for the longest earlier match of a tail (see the
    module docstring). ``append`` grows the last sequence, ``add`` starts a new one."""

    def __init__(self, max_candidates: int = MAX_CANDIDATES,
                 fresh_tokens: int | None = FRESH_TOKENS) -> None:
        """``fresh_tokens``: how many newest tokens may stay unsorted (None: never sort; a
        request's own context, scanned whole each step, is small enough)."""
        self.max_candidates = max_candidates
        self.fresh_tokens = fresh_tokens
        self._buf = np.full(4096, SEP, dtype=np.int32)
        self._end = MAX_DEPTH  # the buffer starts with MAX_DEPTH SEPs: no gather leaves it
        self._sorted_end = self._end  # positions before this are in the sorted keys
        self._keys = np.zeros(0, dtype=np.int64)
        self._positions = np.zeros(0, dtype=np.int32)
        self.live_start = self._end  # earlier positions are evicted: never a candidate

    @property
    def size(self) -> int:
        """Buffer positions in use (tokens and separators, evicted ones included)."""
        return self._end - MAX_DEPTH

    def _reserve(self, more: int) -> None:
        need = self._end + more + MAX_DEPTH + 1
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SEP, dtype=np.int32)
            grown[: self._end] = self._buf[: self._end]
            self._buf = grown

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Extend the last sequence with ``tokens``."""
        array = np.asarray(tokens, dtype=np.int64)
        if array.size == 0:
            return
        self._reserve(array.size)
        self._buf[self._end : self._end + array.size] = np.where(
            (array >= 0) & (array <= MAX_TOKEN_ID), array, SEP)
        self._end += array.size
        if self.fresh_tokens is not None and self._end - self._sorted_end > self.fresh_tokens:
            self.sort()

    def add(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """A new sequence: where its tokens start and end in the buffer."""
        self._reserve(1)
        self._end += 1  # a SEP: the buffer past the end is all SEP
        start = self._end
        self.append(tokens)
        return start, self._end

    def tokens(self, start: int, end: int) -> np.ndarray:
        """The buffer's tokens from ``start`` to ``end`` (a sequence ``add`` placed)."""
        return self._buf[start:end]

    def _keys_of(self, positions: np.ndarray) -> np.ndarray:
        """Each position's key: its token and the two before it (BOUNDARY for a SEP)."""
        keys = np.zeros(positions.size, dtype=np.int64)
        for j in range(3):
            part = self._buf[positions - j].astype(np.int64)
            part[part == SEP] = BOUNDARY
            keys <<= KEY_BITS
            keys |= part
        return keys

    def sorted_part(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Every position's key, sorted (stable: equal keys stay in position order), with the
        positions and the end they cover; reads the buffer only, so a writer may compute it
        while queries run and then ``use_sorted`` it."""
        positions = np.arange(MAX_DEPTH, self._end, dtype=np.int32)
        positions = positions[self._buf[positions] != SEP]
        keys = self._keys_of(positions)
        order = np.argsort(keys, kind="stable")
        return keys[order], positions[order], self._end

    def use_sorted(self, keys: np.ndarray, positions: np.ndarray, end: int) -> None:
        """Take ``sorted_part``'s result (the buffer up to ``end`` unchanged since)."""
        self._keys, self._positions, self._sorted_end = keys, positions, end

    def sort(self) -> None:
        """Fold every position into the sorted keys."""
        self.use_sorted(*self.sorted_part())

    @property
    def end(self) -> int:
        """The position after the last token."""
        return self._end

    @property
    def unsorted(self) -> int:
        """Positions past the sorted keys (scanned at each query)."""
        return self._end - self._sorted_end

    def _sorted_candidates(self, tail: np.ndarray, depth: int) -> np.ndarray:
        """Sorted-part positions ending in the tail's last three tokens (else two, else one;
        never more than ``depth``): the most recent ``max_candidates`` of one key, or an even
        spread of a wider range."""
        t = [int(v) if 0 <= v <= MAX_TOKEN_ID and j < depth else -1
             for j, v in enumerate([*tail[:3], -1, -1][:3])]
        if t[0] < 0 or self._keys.size == 0:
            return np.zeros(0, dtype=np.int32)
        head = t[0] << (2 * KEY_BITS)
        ranges = []  # (low key, high key, one key: its positions in order)
        if t[1] >= 0:
            if t[2] >= 0:
                key = head | (t[1] << KEY_BITS) | t[2]
                ranges.append((key, key + 1, True))
            ranges.append((head | (t[1] << KEY_BITS), head | ((t[1] + 1) << KEY_BITS), False))
        ranges.append((head, head + (1 << (2 * KEY_BITS)), False))
        for low, high, one_key in ranges:
            lo, hi = np.searchsorted(self._keys, [low, high])
            found = self._positions[lo:hi]
            if self.live_start > MAX_DEPTH:  # some were evicted
                found = found[found >= self.live_start]
            if found.size == 0:
                continue
            if one_key:
                return found[-self.max_candidates :]
            if found.size > self.max_candidates:
                found = found[np.linspace(0, found.size - 1, self.max_candidates,
                                          dtype=np.int64)]
            return found
        return np.zeros(0, dtype=np.int32)

    def match(self, tail: np.ndarray, depth: int, before: int | None = None) -> Match:
        """The longest earlier occurrences of ``tail`` (``tail_of``: last token first) up to
        ``depth`` tokens long, with the ``depth`` tokens that followed each (``SEP`` past the
        end of a sequence); only occurrences ending before position ``before`` (None:
        anywhere; a request's own context passes ``end - 1``: its tail is no earlier
        occurrence of itself). ``NO_MATCH`` if none."""
        end = self._end if before is None else min(before, self._end)
        fresh = np.flatnonzero(self._buf[self._sorted_end : end] == tail[0])
        candidates = np.concatenate([
            self._sorted_candidates(tail, depth),
            (fresh[-self.max_candidates :] + self._sorted_end).astype(np.int32)])
        candidates = candidates[(candidates >= self.live_start) & (candidates < end)]
        if candidates.size == 0:
            return NO_MATCH
        back = candidates[:, None] - np.arange(depth)[None, :]  # [candidates, depth]
        same = self._buf[back] == tail[None, :depth]
        lengths = np.where(same.all(axis=1), depth, same.argmin(axis=1))
        longest = int(lengths.max())
        if longest == 0:
            return NO_MATCH
        best = candidates[lengths == longest]
        rows = self._buf[best[:, None] + 1 + np.arange(depth)[None, :]]
        return Match(longest, np.where(np.cumsum(rows == SEP, axis=1) > 0, SEP, rows))


class AnswerHistory:
    """Earlier answers, newest last, at most ``cap_tokens`` tokens: the suffix drafter's global
    index (see the module docstring). Safe to share between threads."""

    def __init__(self, cap_tokens: int, max_candidates: int = MAX_CANDIDATES,
                 fresh_tokens: int = FRESH_TOKENS) -> None:
        if cap_tokens < 0:
            raise ValueError(f"cap_tokens must be >= 0, got {cap_tokens}")
        self.cap_tokens = cap_tokens
        self._max_candidates, self._fresh_tokens = max_candidates, fresh_tokens
        self._lock = threading.Lock()  # queries and changes
        self._write_lock = threading.Lock()  # one writer at a time (its sort outside _lock)
        self._index = TokenIndex(max_candidates, fresh_tokens)
        self._answers: deque[tuple[int, int]] = deque()  # (start, end) in the index, oldest first
        self._tokens = 0
        self.version = 0  # grows with every change: a drafter's cached match is stale then
        self.seeded = False  # the saved conversations were (or are being) read into it

    @property
    def tokens(self) -> int:
        """Tokens of the answers held (evicted ones not counted)."""
        return self._tokens

    @property
    def answers(self) -> int:
        """How many answers it holds."""
        return len(self._answers)

    def add(self, answer: Sequence[int] | np.ndarray, lead: Sequence[int] = ()) -> None:
        """Learn one finished answer's tokens, after the last ``LEAD_TOKENS`` of its prompt
        (``lead``); evict the oldest answers beyond the cap."""
        self.extend([answer], [lead])

    def extend(self, answers: Iterable[Sequence[int] | np.ndarray],
               leads: Iterable[Sequence[int]] | None = None) -> None:
        """Learn answers, oldest first (the store's history at start, in one sort), each after
        the last ``LEAD_TOKENS`` of its prompt where ``leads`` gives them: the end of the
        question and the chat template's turn header, so that the same question asked again
        matches them and its answer is drafted from its first token on. The sort that folds
        new answers into the index runs outside the query lock: drafting goes on meanwhile
        (one writer at a time)."""
        answers = [np.asarray(a, dtype=np.int64) for a in answers]
        leads = [()] * len(answers) if leads is None else list(leads)
        kept = [np.concatenate([np.asarray(list(lead)[-LEAD_TOKENS:], dtype=np.int64), a])
                for a, lead in zip(answers, leads, strict=True) if a.size]
        kept = [a for a in kept if a.size <= self.cap_tokens]
        total, first = 0, len(kept)  # only the newest that fit: the rest would go at once
        while first > 0 and total + kept[first - 1].size <= self.cap_tokens:
            first -= 1
            total += kept[first].size
        kept = kept[first:]
        with self._write_lock:
            with self._lock:
                fresh = self._index.fresh_tokens
                self._index.fresh_tokens = None  # one sort at the end, not one per answer
                for answer in kept:
                    self._answers.append(self._index.add(answer))
                    self._tokens += answer.size
                self._index.fresh_tokens = fresh
                self._evict()
                index = self._index
                self.version += 1
            if index.unsorted > self._fresh_tokens:
                part = index.sorted_part()
                with self._lock:
                    index.use_sorted(*part)

    def _evict(self) -> None:
        """Drop the oldest answers until the rest fit the cap; compact once the dead part
        outweighs the live one."""
        while self._tokens > self.cap_tokens:
            start, end = self._answers.popleft()
            self._tokens -= end - start
        self._index.live_start = self._answers[0][0] if self._answers else self._index.end
        if self._index.live_start - MAX_DEPTH > max(self._tokens, self._fresh_tokens):
            self._compact()

    def _compact(self) -> None:
        """Rebuild the index from the live answers only (frees the evicted ones' memory)."""
        index = TokenIndex(self._max_candidates, None)
        spans = deque(index.add(self._index.tokens(s, e)) for s, e in self._answers)
        index.fresh_tokens = self._fresh_tokens
        index.sort()
        self._index, self._answers = index, spans

    def replace(self, answers: Iterable[Sequence[int] | np.ndarray],
                leads: Iterable[Sequence[int]] | None = None) -> None:
        """Forget every answer, then learn ``answers`` (bench: the same history each run)."""
        with self._write_lock, self._lock:
            self._index = TokenIndex(self._max_candidates, self._fresh_tokens)
            self._answers.clear()
            self._tokens = 0
            self.version += 1
        self.extend(answers, leads)

    def match(self, tail: np.ndarray, depth: int) -> Match:
        """``TokenIndex.match`` over the answers held."""
        with self._lock:
            return self._index.match(tail, depth)

    def nbytes(self) -> int:
        """Bytes of the arrays held (the buffer, the sorted keys and their positions)."""
        i = self._index
        return i._buf.nbytes + i._keys.nbytes + i._positions.nbytes
