"""Sampling under a grammar is exact: a q-sampled draft the grammar refuses is cut before the
pass, and the target's token in its row comes from the residual norm(max(0, p - q)) of the
masked p. Checked on the pure verifier (every branch counted, with negative controls: drawing
from p instead of the residual, or from the unmasked p, is caught) and through the engine (the
first token of a constrained sampled answer, over many seeds, against the masked target's
exact distribution, with the residual fix removed as the negative control)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import collect, decode, make_tiny_model
from grammar_helpers import CHARS, EOS, VOCAB, char_vocab
from test_engine_sampling import chi_square, chi_square_critical

import localspec.engine.engine as engine_module
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.engine.grammar import compile_format
from localspec.engine.verify import verify_sampling
from localspec.output_format import OutputFormat
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs, sample

# p (masked: token 5 refused) and a q that proposes the refused token 40% of the time
P = torch.tensor([0.4, 0.1, 0.2, 0.2, 0.1, 0.0], dtype=torch.float64)
Q = torch.tensor([0.1, 0.3, 0.05, 0.05, 0.1, 0.4], dtype=torch.float64)
UNMASKED = torch.tensor([0.3, 0.075, 0.15, 0.15, 0.075, 0.25], dtype=torch.float64)
ALLOWED = P > 0


def constrained_step(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator,
                     residual_fix: bool = True) -> int:
    """One draft x ~ q; cut if the grammar refuses it (verify with no draft and ``refused``),
    else verified as usual; the first token of the step."""
    x = sample(q, generator)
    rows = torch.stack([p, p])  # [k + 1, vocab]; the second row is never reached by token 0
    if not bool(ALLOWED[x]):
        return verify_sampling(rows[:1], None, [], generator,
                               (x, q) if residual_fix else None).token
    verdict = verify_sampling(rows, q[None], [x], generator)
    return x if verdict.num_accepted else verdict.token


def counts_of(draw: Callable[[], int], n: int) -> torch.Tensor:
    counts = torch.zeros(len(P), dtype=torch.long)
    for _ in range(n):
        counts[draw()] += 1
    return counts


def test_a_refused_draft_s_row_is_drawn_from_the_residual() -> None:
    generator = torch.Generator().manual_seed(0)
    good = counts_of(lambda: constrained_step(P, Q, generator), 3000)
    assert good[5] == 0
    stat, df = chi_square(good, P)
    assert stat < chi_square_critical(df), stat
    # negative controls: p instead of the residual after a refusal; the unmasked p verified
    wrong = counts_of(lambda: constrained_step(P, Q, generator, residual_fix=False), 3000)
    stat, df = chi_square(wrong, P)
    assert stat > chi_square_critical(df), stat
    unmasked = counts_of(lambda: constrained_step(UNMASKED, Q, generator), 3000)
    stat, df = chi_square(unmasked, P)
    assert stat > chi_square_critical(df), stat


def test_a_one_hot_refused_draft_leaves_p() -> None:
    """q one-hot on the refused token (n-gram): the residual is p itself."""
    generator = torch.Generator().manual_seed(1)
    rows = P[None].clone()
    counts = counts_of(lambda: verify_sampling(rows, None, [], generator, (5, None)).token, 4000)
    stat, df = chi_square(counts, P)
    assert stat < chi_square_critical(df), stat


# ----------------------------------------------------------------------------- the engine

DIGITS = [CHARS.index(str(d)) for d in range(10)]
NUMBER = OutputFormat(json={"type": "integer", "minimum": 0, "maximum": 99})
HOT = SamplingParams(temperature=2.5)
PROMPT = [5, 17, 33, 2, 80, 41, 9]


class Skewed(Drafter):
    """Samples one draft from a fixed q: half its mass on a letter (refused where a number
    goes), half on one digit; hands the verifier its q row."""

    traits = DrafterTraits("skewed")

    def __init__(self, digit: int) -> None:
        self.q = torch.zeros(VOCAB)
        self.q[CHARS.index("x")] = 0.5
        self.q[digit] = 0.5

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        token = sample(self.q, generator)
        return Proposal([token], self.q[None].clone(), (float(self.q[token]),))


def first_tokens(engine: SpeculativeEngine, grammar: object, seeds: range) -> torch.Tensor:
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for seed in seeds:
        tokens, _ = collect(engine, GenerationRequest(
            list(PROMPT), max_new_tokens=1, sampling=HOT, num_speculative_tokens=1,
            adaptive=False, seed=seed, grammar=grammar))
        counts[tokens[0]] += 1
    return counts


@pytest.mark.parametrize("residual_fix", [True, False])
def test_constrained_sampling_through_the_engine_is_exact(monkeypatch: pytest.MonkeyPatch,
                                                          residual_fix: bool) -> None:
    target = make_tiny_model(seed=0)
    runner = ModelRunner(target)
    grammar = compile_format(NUMBER, char_vocab())
    logits = runner.forward(PROMPT)[-1:].clone()
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[DIGITS] = True
    p = logits_to_probs(logits.masked_fill(~allowed, float("-inf")), HOT)[0].double()
    assert 0.2 < float(p.max()) < 0.8  # spread enough for the check to have power
    digit = int(p.argmax())
    if not residual_fix:  # the negative control: the refused draft's row drawn from p
        real = engine_module.verify_sampling
        monkeypatch.setattr(engine_module, "verify_sampling",
                            lambda p_, q_, d_, g_, refused=None: real(p_, q_, d_, g_))
    engine = SpeculativeEngine(ModelRunner(target), (Skewed(digit),), decode, {EOS})
    counts = first_tokens(engine, grammar, range(1200))
    assert int(counts[~allowed].sum()) == 0
    stat, df = chi_square(counts[DIGITS], p[DIGITS])
    assert (stat < chi_square_critical(df)) == residual_fix, stat
