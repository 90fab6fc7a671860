"""A draft whose LM head is cut to some rows picks among those rows without spreading its logits
to the whole vocabulary: the same drafts, confidences, siblings and q rows as the spread path,
rows past the tokenizer never drafted."""

from __future__ import annotations

import torch
from conftest import PADDED_VOCAB, VOCAB
from transformers import PreTrainedModel

from localspec.drafters.base import DraftChain
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import spread_logits
from localspec.sampling import SamplingParams, logits_to_probs

GREEDY = SamplingParams(0.0, 0, 1.0)
SAMPLED = SamplingParams(0.8, 20, 0.9)


def _chain(params: SamplingParams, cut: tuple[torch.Tensor, int] | None, logits: torch.Tensor,
           width: int = 1) -> tuple[list[int], tuple[float, ...], list[torch.Tensor]]:
    chain = DraftChain(params, torch.Generator().manual_seed(5), 0.0, None, width, cut)
    for row in logits:
        chain.pick(row)
    proposal = chain.proposal()
    return proposal.tokens, proposal.confidences, chain._q_rows


def test_a_chain_over_cut_logits_drafts_what_the_spread_logits_draft() -> None:
    """A greedy chain (with sibling first guesses) over logits of 9 ids out of 40 proposes the
    same tokens with the same confidences as over those logits spread to 40 with -inf
    elsewhere; a sampled one gives the verifier the spread row's q, 0 off the cut."""
    ids = torch.tensor([0, 2, 3, 7, 11, 19, 25, 31, 39])
    sub = torch.randn(4, len(ids), generator=torch.Generator().manual_seed(0)) * 3
    spread = spread_logits(sub, ids, 40)
    tokens, confidences, _ = _chain(GREEDY, (ids, 40), sub, 3)
    want_tokens, want_confidences, _ = _chain(GREEDY, None, spread, 3)
    assert tokens == want_tokens and len(tokens) == 4 + 2  # the chain and two siblings
    assert torch.allclose(torch.tensor(confidences), torch.tensor(want_confidences))
    tokens, confidences, q_rows = _chain(SAMPLED, (ids, 40), sub)
    want_q = logits_to_probs(spread, SAMPLED)
    assert torch.allclose(torch.stack(q_rows), want_q, atol=1e-6)
    assert set(tokens) <= set(ids.tolist())
    assert confidences == tuple(float(q[t]) for q, t in zip(q_rows, tokens, strict=True))


def test_a_sampled_pick_over_a_cut_draws_from_q() -> None:
    """4,000 first draws over a cut: each id's count within 5 standard deviations of q's."""
    ids = torch.tensor([1, 4, 6, 9, 12])
    sub = torch.tensor([0.5, 1.5, -0.5, 1.0, 0.0])
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(16)
    for _ in range(4000):
        chain = DraftChain(SAMPLED, generator, cut=(ids, 16))
        counts[chain.pick(sub)] += 1
    q = logits_to_probs(spread_logits(sub, ids, 16)[None], SAMPLED)[0]
    assert ((counts - 4000 * q).abs() <= 5 * (4000 * q * (1 - q)).sqrt() + 1e-9).all()


def test_a_cut_draft_model_proposes_as_its_spread_logits_do(
        padded_draft_model: PreTrainedModel) -> None:
    """The draft model's cut includes its padding rows (rigged to win the argmax): they stay
    masked, and every proposal equals the one made through the whole spread vocabulary."""
    rows = torch.tensor([*range(0, VOCAB, 2), *range(VOCAB, PADDED_VOCAB)])
    runner = ModelRunner(padded_draft_model, vocab_rows=rows)
    assert torch.equal(runner.vocab_rows, rows)
    spread = runner.forward([1, 2, 3])
    runner.reset()
    assert torch.equal(runner.forward([1, 2, 3], spread=False), spread[:, rows])

    def proposals(cut: bool) -> list[list[int]]:
        drafter = DraftModelDrafter(ModelRunner(padded_draft_model, vocab_rows=rows),
                                    target_vocab_size=VOCAB, tokenizer_vocab_size=VOCAB)
        assert drafter._cut is not None and drafter._invalid is not None
        if not cut:
            drafter._cut = None
        generator = torch.Generator().manual_seed(0)
        context = [5, 9, 14]
        out = []
        for step in range(6):
            tokens = drafter.propose(context, 4, GREEDY, generator).tokens
            out.append(tokens)
            context = context + tokens[: step % 3 + 1]
        return out

    made = proposals(cut=True)
    assert made == proposals(cut=False)
    assert all(0 <= t < VOCAB and t % 2 == 0 for tokens in made for t in tokens)
