"""One answer's grammar in the engine's step: shape the drafts, mask the target, advance.

The engine calls a ``Constraint`` at three points of each step, and nowhere else:

1. ``shape(proposal, room)`` before the target's pass: the drafts are walked through the
   grammar's matcher. The first draft the grammar refuses is cut, with everything after it,
   and never fed ("rejected without a pass"); its q row is kept, because the target's token at
   that row must then come from the residual ``norm(max(0, p - q))`` (``verify_sampling``'s
   ``refused``). Where the grammar allows one token only, that token is a *forced* draft, free
   because the masked target keeps it with probability 1: it replaces a draft that differs
   (and ends the drafter's chain there). After the drafter's last token the grammar's own
   drafts follow, bounded by ``MAX_FORCED_DRAFTS``: forced tokens, and the tokenization of the
   text the grammar forces next (jump-forward: a literal tag, a property name), each one-hot
   (q = None) and verified like any draft. Each row's allowed tokens are kept: row i is the
   grammar's state after the context and the first i drafts.
2. ``mask(logits, shaped)`` right after the pass: the refused tokens' logits become -inf, row
   by row, before ``verify_greedy`` or ``logits_to_probs``. p is the masked target.
3. ``advance(shaped, kept)`` once the step's tokens are known: the matcher rolls back the
   drafts that were not kept and reads the target's own token.

So the kept tokens are exactly what decoding one token at a time from the masked target gives
(greedy: the same tokens; sampled: the same distribution), whatever the drafter proposed; the
end-of-sequence token is allowed exactly where the grammar may end, and where nothing else may
follow it is forced. Trees are verified as their chain (a constraint takes the first chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localspec.config import MAX_FORCED_DRAFTS
from localspec.engine.drafter import Proposal
from localspec.engine.grammar import CompiledGrammar, fill_mask, mask_words


@dataclass(frozen=True)
class Shaped:
    """A proposal as the grammar lets it through."""

    proposal: Proposal  # what the target verifies: every token allowed where it stands
    allowed: torch.Tensor  # [len(proposal.tokens) + 1, vocab] bool: row i after tokens[:i]
    refused: tuple[int, torch.Tensor | None] | None  # the draft cut at the last row, its q row
    own: int  # the leading tokens that are the drafter's own (for its statistics)
    forced: int  # tokens the grammar forced (the only one allowed): kept with probability 1
    grammar_only: bool  # every token is the grammar's (the drafter proposed none of them)


class Constraint:
    """The grammar's matcher for one answer; the engine's three calls per step."""

    def __init__(self, grammar: CompiledGrammar, jump_forward: bool = True) -> None:
        """``jump_forward``: append the tokens of the text the grammar forces as drafts (off:
        only single forced tokens are drafted by the grammar)."""
        self.matcher = grammar.matcher()
        self.vocab_size = grammar.vocab.vocab_size
        self.eos = grammar.vocab.eos
        self.jump_forward = jump_forward
        self._bits = torch.zeros((1, mask_words(self.vocab_size)), dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._fed = 0  # tokens the matcher read past the answer's kept tokens (drafts)

    def _allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next; the end only, once it ended."""
        if self.matcher.is_stopped():
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        else:
            fill_mask(self.matcher, self._bits, 0)
            words = self._bits[0].unsqueeze(-1)  # [words, 1]
            allowed = ((words >> self._shifts) & 1).bool().flatten()[: self.vocab_size]
        if not allowed.any():  # a finished (or failed) grammar: only the end remains
            allowed[self.eos] = True
        return allowed

    def _read(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token} it allowed: "
                               f"{self.matcher.get_error()[:300]}")

    def shape(self, proposal: Proposal, room: int) -> Shaped:
        """The drafts the target may see this step (at most ``room``: the tokens the answer may
        still take), with each row's allowed tokens; see the module docstring."""
        chain = proposal.chain_length
        drafts = proposal.tokens[:chain]
        q_draft = proposal.q_draft
        tokens: list[int] = []
        q_rows: list[torch.Tensor | None] = []
        confidences: list[float] = []
        rows: list[torch.Tensor] = []
        refused: tuple[int, torch.Tensor | None] | None = None
        own = forced = extra = 0
        jump: list[int] | None = None
        while True:
            allowed = self._allowed()
            rows.append(allowed)
            if len(tokens) >= room or self.matcher.is_stopped():
                break
            single = int(allowed.nonzero()[0]) if int(allowed.sum()) == 1 else None
            if own == len(tokens) and own < len(drafts):  # still on the drafter's chain
                draft = drafts[own]
                q_row = None if q_draft is None else q_draft[own]
                if single is not None and draft != single:
                    token, q_row, confidence = single, None, 1.0  # replaces it; ends the chain
                elif 0 <= draft < self.vocab_size and bool(allowed[draft]):
                    token = draft
                    confidence = (proposal.confidences[own] if own < len(proposal.confidences)
                                  else 1.0)
                    own += 1
                else:
                    refused = (draft, q_row)
                    break
            else:  # the grammar's own drafts after the drafter's
                if extra >= MAX_FORCED_DRAFTS or (single is None and not self.jump_forward):
                    break
                if jump is None:
                    jump = list(self.matcher.compute_ff_tokens()) if self.jump_forward else []
                token = single if single is not None else (jump[0] if jump else -1)
                if token < 0 or not bool(allowed[token]):
                    break
                if jump and jump[0] == token:
                    jump.pop(0)
                else:
                    jump = []
                q_row, confidence = None, 1.0
                extra += 1
            forced += single is not None
            self._read(token)
            self._fed += 1
            tokens.append(token)
            q_rows.append(q_row)
            confidences.append(confidence)
        shaped = Proposal(tokens, _q_rows(q_rows, tokens, q_draft), tuple(confidences),
                          proposal.sync_time)
        return Shaped(shaped, torch.stack(rows), refused, own, forced,
                      grammar_only=own == 0 and bool(tokens))

    def mask(self, logits: torch.Tensor, shaped: Shaped) -> torch.Tensor:
        """``logits`` [rows, vocab] with every token the grammar refuses at -inf (a copy: the
        runner's logits may be its own buffer)."""
        allowed = shaped.allowed[: logits.shape[0]].to(logits.device)
        width = min(logits.shape[-1], allowed.shape[-1])
        refused = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        refused[:, :width] = ~allowed[:, :width]
        return logits.masked_fill(refused, float("-inf"))

    def advance(self, shaped: Shaped, kept: list[int]) -> None:
        """Roll the matcher back to the drafts ``kept`` starts with and read the rest of it
        (the target's own token)."""
        same = 0
        drafts = shaped.proposal.tokens
        while same < min(len(kept), len(drafts)) and kept[same] == drafts[same]:
            same += 1
        if self._fed > same:
            self.matcher.rollback(self._fed - same)
        self._fed = 0
        for token in kept[same:]:
            self._read(token)


def _q_rows(rows: list[torch.Tensor | None], tokens: list[int],
            q_draft: torch.Tensor | None) -> torch.Tensor | None:
    """[len(tokens), vocab] q rows, one-hot where the grammar drafted; None if all are."""
    if q_draft is None or all(row is None for row in rows):
        return None
    out = torch.zeros((len(tokens), q_draft.shape[-1]), dtype=q_draft.dtype,
                      device=q_draft.device)
    for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        if row is None:
            out[i, token] = 1.0
        else:
            out[i] = row
    return out
