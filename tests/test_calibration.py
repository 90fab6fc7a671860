"""Online calibration of a drafter's confidence: it learns how often guesses of each confidence
are accepted, counts a chain only up to its first rejection, stops an overconfident drafter's
chain where the raw confidence would not, and the engine feeds it every verified chain while
the output stays the target's own."""

from __future__ import annotations

import pytest
import torch
from conftest import collect, decode, draft_drafter
from engine_helpers import PROMPTS, plain_tokens, request
from transformers import PreTrainedModel

from localspec.drafters.base import Calibration, DraftChain
from localspec.engine.engine import SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0)


def test_an_unseen_confidence_is_trusted_and_a_seen_one_learned() -> None:
    calibration = Calibration()
    assert calibration.chance(0.65) == pytest.approx(0.65)
    for i in range(100):  # guesses at 0.65 accepted 16 times in 100
        calibration.record((0.65,), accepted=1 if i % 25 < 4 else 0)
    assert calibration.chance(0.65) == pytest.approx((16 + 8 * 0.65) / 108)
    assert calibration.chance(0.95) == pytest.approx(0.95)  # another bin: still the prior


def test_a_chain_counts_up_to_its_first_rejection() -> None:
    calibration = Calibration()
    calibration.record((0.95, 0.92, 0.91, 0.97), accepted=1)
    assert calibration.drafted[9] == 2 and calibration.accepted[9] == 1
    calibration.record((0.15, 0.95), accepted=2)  # all kept
    assert calibration.drafted[1] == 1 and calibration.accepted[1] == 1
    assert calibration.drafted[9] == 3 and calibration.accepted[9] == 2


def test_the_kept_share_speaks_once_enough_guesses_were_judged() -> None:
    """Every judged guess counts, in any bin; before ``LEARNT`` of them there is no share."""
    calibration = Calibration()
    for i in range(Calibration.LEARNT - 1):
        calibration.record((0.35 if i % 2 else 0.85,), accepted=int(i % 3 == 0))
    assert calibration.kept_share() is None
    calibration.record((0.55, 0.9), accepted=0)  # the second guess is never judged
    judged = Calibration.LEARNT
    assert calibration.kept_share() == pytest.approx(
        sum(1 for i in range(judged - 1) if i % 3 == 0) / judged)


def test_an_overconfident_drafter_stops_where_its_chance_is_low() -> None:
    logits = torch.full((8,), -10.0)
    logits[3] = 0.0
    logits[4] = float(torch.log(torch.tensor(0.65 / 0.35)))  # best guess at ~0.65
    overconfident = Calibration()
    for _ in range(50):
        overconfident.record((0.65,), accepted=0)

    def drafted(calibration: Calibration | None) -> int:
        chain = DraftChain(GREEDY, torch.Generator(), 0.3, calibration)
        for n in range(1, 5):
            chain.pick(logits)
            if chain.done:
                return n
        return 4

    # the chain's chance: 0.65, 0.42, then 0.27 < 0.3 ends it at its third guess, kept
    assert drafted(None) == 3 and drafted(Calibration()) == 3
    assert drafted(overconfident) == 1  # the first draft is always made


def test_a_chain_stops_on_the_chance_of_all_its_guesses() -> None:
    """Guesses at 0.9 each: the chain's chance falls 0.9, 0.81, 0.73, 0.66, so a threshold of
    0.7 ends it at the fourth, which is still proposed; none ends a chain that never starts."""
    logits = torch.full((8,), -10.0)
    logits[2] = 0.0
    logits[5] = float(torch.log(torch.tensor(0.1 / 0.9)))
    chain = DraftChain(GREEDY, torch.Generator(), 0.7)
    picks = []
    while not chain.done:
        picks.append(chain.pick(logits))
    assert picks == [2, 2, 2, 2]
    assert chain.proposal().tokens == picks
    assert chain.chance == pytest.approx(0.9**4, rel=1e-3)
    assert not DraftChain(GREEDY, torch.Generator(), 0.7).done


def test_the_engine_records_every_verified_chain(target_runner: ModelRunner,
                                                 close_draft_model: PreTrainedModel,
                                                 target_model: PreTrainedModel) -> None:
    """Each step's judged drafts (the accepted ones and the first rejected) reach the drafter's
    calibration, which outlives a new answer, but the last step's (the drafter reads a verdict
    off the next context it is shown, and the answer ends there); the tokens are plain
    decoding's."""
    drafter = draft_drafter(close_draft_model, threshold=0.3)
    engine = SpeculativeEngine(target_runner, (drafter,), decode, set())
    prompt = PROMPTS["random-b"]
    tokens, events = collect(engine, request(prompt, k=4, max_new_tokens=40))
    assert tokens == plain_tokens(target_model, prompt, max_new_tokens=40)
    judged = sum(min(e.accepted + 1, len(e.drafted)) for e in events[:-1])
    kept = sum(e.accepted for e in events[:-1])
    assert 0 < kept < judged  # acceptances and rejections both occurred
    assert sum(drafter.calibration.drafted) == judged
    assert sum(drafter.calibration.accepted) == kept
    collect(engine, request(prompt, k=4, max_new_tokens=8))
    assert sum(drafter.calibration.drafted) > judged
