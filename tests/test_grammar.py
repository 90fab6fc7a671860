"""Structured output on tiny random models: formats compile or fail with a FormatError that
says why (never a hang); under a JSON-schema or tool-call format, greedy output with every
drafter (none, n-gram, draft models good and bad, lookup in front of a draft model, EAGLE,
EAGLE-3 and Medusa heads) is token for token the obvious reference (one full forward per token,
masked, argmax), ends where the grammar may end and validates against the schema; a draft the
grammar refuses is never fed to the target; forced tokens are free drafts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import jsonschema
import pytest
import torch
from conftest import collect, decode, draft_drafter, make_tiny_model, perturbed_copy
from grammar_helpers import (
    ARGS,
    EOS,
    FORMATS,
    PERSON,
    TAG,
    VOCAB,
    calls_of,
    char_tokenizer,
    char_vocab,
    reference_tokens,
    text_of,
)
from test_eagle_medusa import drafter_for, random_head
from transformers import PreTrainedModel

from localspec.config import MAX_FORCED_DRAFTS
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.constraint import Constraint
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.engine.grammar import (
    FormatError,
    GrammarCache,
    GrammarVocab,
    compile_format,
)
from localspec.output_format import OutputFormat, TaggedJson
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PROMPT = [5, 17, 33, 2, 80, 41, 9]
MAX_NEW = 200


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    return char_vocab()


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return make_tiny_model(seed=0)


def request(grammar: object, k: int = 4, max_new: int = MAX_NEW,
            sampling: SamplingParams | None = None, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=max_new,
                             sampling=sampling or SamplingParams(), num_speculative_tokens=k,
                             adaptive=False, seed=seed, grammar=grammar)


# ----------------------------------------------------------------------------- compile


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "strin"}, "Invalid type: strin"),  # malformed
    ({"type": "object", "not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ({"type": "string", "minLength": 3, "maxLength": 1}, "minLength (3) is greater"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    ({"$ref": "#"}, "no answer satisfies"),  # recursion without a way out
    (False, "a JSON schema is an object"),
    ([1, 2], "a JSON schema is an object"),
    ({"const": float("nan")}, "not JSON"),
])
def test_unusable_schemas_are_format_errors(vocab: GrammarVocab, schema: object,
                                            needle: str) -> None:
    with pytest.raises(FormatError) as caught:
        compile_format(OutputFormat(json=schema), vocab)  # type: ignore[arg-type]
    assert needle in str(caught.value)
    assert "<state>" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_format_over_the_size_limit_is_refused_before_compiling(vocab: GrammarVocab) -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    with pytest.raises(FormatError, match="at most 1,000 are accepted"):
        compile_format(OutputFormat(json=big), vocab, max_chars=1000)


def test_a_slow_compile_is_refused_at_the_time_limit(vocab: GrammarVocab) -> None:
    """The limit is wall-clock: the answer comes at the limit, whatever the compile does."""
    big = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{2,{i + 3}}}[0-9]{{1,{i % 7 + 2}}}$"}
        for i in range(300)}}
    start = time.perf_counter()
    with pytest.raises(FormatError, match="did not compile within"):
        compile_format(OutputFormat(json=big), vocab, timeout_s=1e-4)
    assert time.perf_counter() - start < 1.0
    compile_format(OutputFormat(json=big), vocab)  # within the default limit it compiles


def test_a_tag_no_trigger_starts_is_refused(vocab: GrammarVocab) -> None:
    with pytest.raises(FormatError, match="starts with none of the triggers"):
        compile_format(OutputFormat(tags=(TAG,), triggers=("<tool>",)), vocab)


def test_recursive_refs_compile_and_match(vocab: GrammarVocab) -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/node"}
    matcher = compile_format(OutputFormat(json=tree), vocab).matcher()
    text = '{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]}'
    ids = char_tokenizer().encode(text)
    assert matcher.validate_tokens(ids) == len(ids)
    wrong = char_tokenizer().encode('{"v": 1, "kids": [{"v": "')  # a string where a number goes
    assert matcher.validate_tokens(wrong) == len(wrong) - 1


def test_the_cache_compiles_a_format_once(vocab: GrammarVocab,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import localspec.engine.grammar as grammar

    calls: list[str] = []
    real = grammar.compile_format
    monkeypatch.setattr(grammar, "compile_format",
                        lambda output, v: calls.append(output.key()) or real(output, v))
    cache = GrammarCache(vocab, size=2)
    first = cache.get(FORMATS["json"])
    assert cache.get(OutputFormat(json=dict(PERSON))) is first  # an equal format, another object
    cache.get(FORMATS["tags-only"])
    cache.get(FORMATS["triggered"])  # the least recently used (json) is dropped
    cache.get(FORMATS["json"])
    assert len(calls) == 4
    with pytest.raises(FormatError):
        cache.get(OutputFormat(json={"type": "strin"}))


# ----------------------------------------------------------------------------- lossless


def drafters(kind: str, target: PreTrainedModel, runner: ModelRunner) -> tuple[Drafter, ...]:
    if kind in ("eagle", "eagle3", "medusa"):
        return (drafter_for(kind, random_head(kind, target), runner),)
    return {
        "none": lambda: (),
        "ngram": lambda: (NgramDrafter(prompt_lookup_max=4, prompt_lookup_min=1),),
        "close-draft": lambda: (draft_drafter(perturbed_copy(target, seed=2, noise=0.5)),),
        "random-draft": lambda: (draft_drafter(make_tiny_model(seed=1)),),
        "self-draft": lambda: (draft_drafter(target),),
        "auto": lambda: (NgramDrafter(3, 1), draft_drafter(perturbed_copy(target, 2, 0.5))),
    }[kind]()


KINDS = ("none", "ngram", "close-draft", "random-draft", "self-draft", "auto")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_greedy_output_is_plain_constrained_decoding(vocab: GrammarVocab, target: PreTrainedModel,
                                                     kind: str, form: str) -> None:
    grammar = compile_format(FORMATS[form], vocab)
    runner = ModelRunner(target)
    engine = SpeculativeEngine(runner, drafters(kind, target, runner), decode, {EOS})
    tokens, events = collect(engine, request(grammar))
    assert tokens == reference_tokens(target, PROMPT, grammar, MAX_NEW)
    # a random model calls the tool again and again: its answer of calls ends at the length,
    # unless the format allows one call, after which the end is forced
    assert events[-1].finish_reason == ("length" if form == "tags-only" else "eos")
    if form == "json" or (form == "json-or-tag" and not text_of(tokens).startswith("<")):
        jsonschema.validate(json.loads(text_of(tokens)), PERSON)
    elif form != "triggered":
        calls = calls_of(text_of(tokens))
        assert calls and text_of(tokens).startswith("<call>")
        assert len(calls) == 1 or form == "tags-only"
        for call in calls:
            assert call["name"] == "f"
            jsonschema.validate(call["arguments"], ARGS)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_heads_under_a_grammar_keep_plain_constrained_output(vocab: GrammarVocab,
                                                             method: str) -> None:
    from head_models import llama_target

    model = llama_target()
    runner = ModelRunner(model)
    (head,) = drafters(method, model, runner)
    proposed: list[int] = []
    propose = head.propose
    head.propose = lambda *a, **kw: (p := propose(*a, **kw), proposed.append(len(p.tokens)))[0]
    engine = SpeculativeEngine(runner, (head,), decode, {EOS})
    for form in ("json", "tags-only"):
        grammar = compile_format(FORMATS[form], vocab)
        tokens, _ = collect(engine, request(grammar, k=3))
        assert tokens == reference_tokens(model, PROMPT, grammar, MAX_NEW), form
    assert sum(proposed) > 0  # the head drafted (its guesses were verified or refused)


class Feeds:
    """Records what each forward pass of a runner was fed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.feeds: list[tuple[int, list[int]]] = []  # (cache length before, tokens fed)
        forward = runner.forward

        def recording(tokens: list[int], *args: object, **kwargs: object) -> torch.Tensor:
            self.feeds.append((runner.length, list(tokens)))
            return forward(tokens, *args, **kwargs)

        runner.forward = recording  # type: ignore[method-assign]


def test_refused_drafts_are_never_fed(vocab: GrammarVocab, target: PreTrainedModel) -> None:
    """A random draft model guesses mostly what the grammar refuses: every token the target
    is fed after the prompt is one the grammar allows where it stands (checked by a fresh
    matcher over the answer so far), and the refusals still cost drafts, not passes."""
    grammar = compile_format(FORMATS["json"], vocab)
    runner = ModelRunner(target)
    feeds = Feeds(runner)
    engine = SpeculativeEngine(runner, drafters("random-draft", target, runner), decode, {EOS})
    tokens, events = collect(engine, request(grammar))
    answer = [*PROMPT, *tokens]
    for start, fed in feeds.feeds[1:]:  # the first is the prompt's prefill
        matcher = grammar.matcher()
        before = answer[len(PROMPT):start + 1]  # the answer up to the pending token
        assert matcher.validate_tokens(before) == len(before)
        assert all(matcher.consume_token(t) for t in before)
        assert matcher.validate_tokens(fed[1:]) == len(fed) - 1, (start, fed)
    assert len(feeds.feeds) - 1 == len(events)


class Fixed(Drafter):
    """Proposes the same tokens after every context."""

    traits = DrafterTraits("fixed")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        return Proposal(self.tokens[:k])


def ids(text: str) -> list[int]:
    return char_tokenizer().encode(text)


def test_forced_tokens_replace_wrong_drafts_and_follow_the_drafters(vocab: GrammarVocab) -> None:
    """Inside a literal (the tag's begin) the grammar allows one token: a draft that differs
    is replaced by it and the drafter's chain ends there; after the drafter's last token the
    forced ones follow (at most MAX_FORCED_DRAFTS); every forced token is counted, and it is
    the only one allowed in its row."""
    constraint = Constraint(compile_format(FORMATS["tags-only"], vocab), jump_forward=False)
    shaped = constraint.shape(Proposal(ids("<cal")), room=50)
    begin = ids(TAG.begin)
    assert shaped.proposal.tokens == begin[:4 + MAX_FORCED_DRAFTS]
    assert shaped.own == 4 and shaped.refused is None
    assert shaped.forced == 4 + MAX_FORCED_DRAFTS  # a literal: each token the only one allowed
    assert all(int(row.sum()) == 1 for row in shaped.allowed[:-1])
    constraint.advance(shaped, [])
    shaped = constraint.shape(Proposal(ids("<cXl>")), room=50)
    assert shaped.proposal.tokens == begin[:3 + MAX_FORCED_DRAFTS]
    assert shaped.own == 2 and shaped.forced == 3 + MAX_FORCED_DRAFTS
    assert shaped.proposal.confidences[2] == 1.0
    constraint.advance(shaped, [])
    shaped = constraint.shape(Proposal(ids("<cal")), room=3)  # never more than the room
    assert len(shaped.proposal.tokens) == 3


def test_a_refused_draft_is_cut_with_its_q_row(vocab: GrammarVocab) -> None:
    constraint = Constraint(compile_format(FORMATS["json"], vocab))
    q = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    drafts = ids('":x')  # after '{"name', a string must open where "x" stands
    constraint.advance(constraint.shape(Proposal([]), room=0), ids('{"name'))
    shaped = constraint.shape(Proposal(drafts, q), room=50)
    assert shaped.proposal.tokens == drafts[:2] and shaped.refused is not None
    assert shaped.refused[0] == drafts[2] and torch.equal(shaped.refused[1], q[2])
    assert not bool(shaped.allowed[2, drafts[2]]) and shaped.allowed.shape == (3, VOCAB)
    assert int(shaped.allowed[2].sum()) > 1  # not forced: several tokens may follow
    assert torch.equal(shaped.proposal.q_draft, q[:2])
    logits = constraint.mask(torch.zeros(3, VOCAB), shaped)
    assert torch.equal(torch.isfinite(logits), shaped.allowed)
    constraint.advance(shaped, [drafts[0], ids(" ")[0]])  # kept '"', then the target's " "
    assert constraint.shape(Proposal(ids(':"ab')), room=50).own == 4


def test_a_trigger_in_free_text_starts_a_tool_call(vocab: GrammarVocab) -> None:
    """Free text is free until the trigger; then the tag's begin is forced, its arguments
    follow the schema, and after its end the text is free again."""
    constraint = Constraint(compile_format(FORMATS["triggered"], vocab), jump_forward=False)
    free = constraint.shape(Proposal(ids("Hi there <call>")), room=50)
    assert free.own == 15 and free.refused is None
    assert int(free.allowed[0].sum()) == VOCAB  # anything, the end included
    forced = free.proposal.tokens[15:]  # the begin's rest, as far as the bound goes
    assert text_of(forced) == '{"name": "f", "arguments": '[:MAX_FORCED_DRAFTS]
    constraint.advance(free, free.proposal.tokens)
    rest = constraint.shape(Proposal([]), room=50)
    assert text_of(rest.proposal.tokens) == '{"name": "f", "arguments": {'[MAX_FORCED_DRAFTS:]
    constraint.advance(rest, rest.proposal.tokens)
    bad = constraint.shape(Proposal(ids('"x":Q')), room=50)  # a number goes where Q stands
    assert bad.refused is not None and text_of(bad.proposal.tokens) == '"x":'
    constraint.advance(bad, ids('"x": 3, "unit": "c"}}</call> ok'))
    assert int(constraint.shape(Proposal([]), room=5).allowed[0].sum()) == VOCAB


def test_a_grammar_that_ends_forces_the_end(vocab: GrammarVocab) -> None:
    """A value with one spelling is drafted whole; then the end is allowed."""
    constraint = Constraint(compile_format(OutputFormat(json={"enum": ["yes"]}), vocab))
    shaped = constraint.shape(Proposal([]), room=20)
    assert text_of(shaped.proposal.tokens) == '"yes"' and shaped.forced == 5
    assert bool(shaped.allowed[-1, EOS])  # then the end (or trailing blanks)


def test_json_or_one_call_takes_either_and_ends_after_it(vocab: GrammarVocab) -> None:
    call = TAG.begin + '{"x": 3, "unit": "c"}' + TAG.end
    person = '{"name": "Al", "mood": "ok", "age": 3}'
    grammar = compile_format(FORMATS["json-or-tag"], vocab)
    for text, accepted in ((person, True), (call, True), (call + "\n" + call, False),
                           ("Hi" + call, False)):
        matcher = grammar.matcher()
        consumed = all(matcher.consume_token(t) for t in ids(text))
        assert (consumed and matcher.is_accepting()) == accepted, text


def test_special_tokens_in_literals_are_referred_to_by_id() -> None:
    """A tag's literal text that holds an added token of the tokenizer is that token."""
    from localspec.engine.grammar import to_lark

    vocab = GrammarVocab(tokenizer=None, vocab_size=10, eos=0,  # type: ignore[arg-type]
                         added=(("</tool_call>", 8), ("<tool_call>", 7)))
    tag = TaggedJson('<tool_call>\n{"name": "f", "arguments": ', True, "}\n</tool_call>")
    lark = to_lark(OutputFormat(tags=(tag,), triggers=("<tool_call>",)), vocab)
    assert "seg_0: TEXT <[7]> (" in lark and '"}\\n" <[8]>' in lark
    assert "[lazy]" not in lark  # free text cannot hold an added token: it ends there
    lark = to_lark(OutputFormat(tags=(TaggedJson("<x>", True, "</x>"),), triggers=("<x",)),
                   vocab)
    assert 'trig_0[lazy]: TEXT "<x"' in lark


def plain_engine(target: PreTrainedModel) -> Callable[[GenerationRequest], list[int]]:
    engine = SpeculativeEngine(ModelRunner(target), (), decode, {EOS})
    return lambda r: collect(engine, r)[0]


def test_max_new_tokens_cuts_a_constrained_answer(vocab: GrammarVocab,
                                                  target: PreTrainedModel) -> None:
    grammar = compile_format(FORMATS["json"], vocab)
    engine = SpeculativeEngine(ModelRunner(target), drafters("ngram", target, ModelRunner(target)),
                               decode, {EOS})
    tokens, events = collect(engine, request(grammar, max_new=7))
    assert len(tokens) == 7 and events[-1].finish_reason == "length"
    assert tokens == reference_tokens(target, PROMPT, grammar, 7)
