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
from localspec.sampling import SamplingParams

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
    """Greedy (with sibling first guesses) and sampled chains over logits of 9 ids out of 40
    propose the same tokens, with the same confidences and (sampled) the same q rows, as over
    those logits spread to 40 with -inf elsewhere."""
    ids = torch.tensor([0, 2, 3, 7, 11, 19, 25, 31, 39])
    sub = torch.randn(4, len(ids), generator=torch.Generator().manual_seed(0)) * 3
    spread = spread_logits(sub, ids, 40)
    for params, width in ((GREEDY, 3), (SAMPLED, 1)):
        tokens, confidences, q_rows = _chain(params, (ids, 40), sub, width)
        want_tokens, want_confidences, want_q = _chain(params, None, spread, width)
        assert tokens == want_tokens and set(tokens) <= set(ids.tolist())
        assert torch.allclose(torch.tensor(confidences), torch.tensor(want_confidences))
        if params is SAMPLED:
            assert all(torch.equal(q, want) for q, want in zip(q_rows, want_q, strict=True))
    assert len(_chain(GREEDY, (ids, 40), sub, 3)[0]) == 4 + 2  # the chain and two siblings


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
