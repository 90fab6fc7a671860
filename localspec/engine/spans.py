"""Each token of an answer as a span: its text, where it came from (an accepted draft, the
target's recovered or bonus token, the target's token on a step that drafted nothing, or a
rejected draft), and its probabilities. The app colours these spans and the API returns them;
neither needs tensors.

Token text: each token's text is what it adds to the decoded text, found by decoding a short
window of the preceding tokens with and without it (so SentencePiece's leading spaces and
byte-level BPE both come out right). A character whose UTF-8 bytes are split over several tokens
is given to the token that completes it; the earlier ones have empty text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from localspec.engine.engine import StepEvent

KINDS = ("accepted", "recovered", "bonus", "target", "rejected")


@dataclass(frozen=True)
class TokenSpan:
    """One token as shown: its text, where it came from, and what the hover says."""

    text: str
    kind: str  # one of KINDS
    step: int
    token_id: int
    p_target: float | None = None  # p(token) under the target, where known
    q_draft: float | None = None  # q(token) under the drafter, where drafted
    drafter: str | None = None  # which drafter guessed it, where drafted (StepEvent.drafter)


class TokenTexts:
    """Per-token text by incremental decoding over a short window of the preceding tokens."""

    def __init__(self, decode: Callable[[list[int]], str], window: int = 8) -> None:
        self.decode = decode
        self.window = window
        self.ids: list[int] = []  # tokens whose text ends on a whole character
        self.pending: list[int] = []  # tokens of a character not yet complete

    def _piece(self, context: list[int], pending: list[int], token: int) -> tuple[str, bool]:
        """(text the token adds, whether it completes a character) after context + pending."""
        head = context[-self.window :]
        before = self.decode(head) if head else ""
        after = self.decode([*head, *pending, token])
        if after.endswith("\ufffd"):
            return "", False
        if not after.startswith(before):  # a decoder that rewrites earlier text: best effort
            return self.decode([*pending, token]), True
        return after[len(before) :], True

    def append(self, tokens: Iterable[int]) -> list[str]:
        """Texts of tokens that join the output (state advances)."""
        texts = []
        for token in tokens:
            text, complete = self._piece(self.ids, self.pending, token)
            texts.append(text)
            if complete:
                self.ids.extend([*self.pending, token])
                self.pending = []
            else:
                self.pending.append(token)
        return texts

    def preview(self, tokens: Iterable[int]) -> list[str]:
        """Texts tokens would have had after the current output (state unchanged)."""
        ids, pending, texts = list(self.ids), list(self.pending), []
        for token in tokens:
            text, complete = self._piece(ids, pending, token)
            texts.append(text)
            if complete:
                ids.extend([*pending, token])
                pending = []
            else:
                pending.append(token)
        if pending and texts:  # an incomplete character at the end of a rejected run
            texts[-1] = texts[-1] or "\ufffd"
        return texts


def event_spans(event: StepEvent, texts: TokenTexts) -> list[TokenSpan]:
    """Spans for one step: accepted drafts, the rejected ones in place, the target's token."""
    kept_accepted = min(event.accepted, len(event.tokens))
    spans = []
    accepted_ids = event.tokens[:kept_accepted]
    for i, (token, text) in enumerate(zip(accepted_ids, texts.append(accepted_ids), strict=True)):
        q = event.q_draft[i] if i < len(event.q_draft) else None
        spans.append(TokenSpan(text, "accepted", event.step, token, event.p_target[i], q,
                               event.drafter))
    rejected = event.rejected
    for j, (token, text) in enumerate(zip(rejected, texts.preview(rejected), strict=True)):
        i = event.accepted + j
        q = event.q_draft[i] if i < len(event.q_draft) else None
        spans.append(TokenSpan(text, "rejected", event.step, token, None, q, event.drafter))
    for i in range(kept_accepted, len(event.tokens)):  # the target's own token, if not cut off
        token = event.tokens[i]
        kind = event.target_token_kind if event.drafted else "target"
        (text,) = texts.append([token])
        spans.append(TokenSpan(text, kind, event.step, token, event.p_target[i], None))
    return spans
