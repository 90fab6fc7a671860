"""A loaded preset: target and draft models, and engines for each method over them.

The CLI, the benchmark and the app all go through here, so a model is loaded once and shared by
every method that a comparison runs. Which methods there are, what each needs and how its
drafter is made come from the drafter registry (``localspec.registry``): the pipeline checks the
needs, imports the method's ``build`` and calls it with itself as the ``BuildContext``. A method
that needs a head (EAGLE, EAGLE-3, Medusa) reads it from ``[speculative_config] model`` when its
engine is first asked for; the head shares the target's runner (it reads its features).

What a request or a method choice may be is decided from the preset alone
(``request_settings_for``, ``Preset.drafter_set``), before any model is loaded: a typo in a flag
must not cost a model load, and a benchmark must not fail halfway through on a method its preset
cannot run. A method is resolved once into its ``DrafterSet``; the engine gets its members'
drafters as a tuple, and its policy picks among them each step.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from localspec.config import (
    DEFAULT_CONTEXT,
    HISTORY_DRAFT_TOKENS,
    ModelSpec,
    Preset,
    RequestSettings,
    request_settings,
)
from localspec.drafter_set import DrafterSet
from localspec.drafters.base import BuildContext
from localspec.drafters.suffix_index import AnswerHistory
from localspec.engine.drafter import Drafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine, StepEvent
from localspec.engine.grammar import CompiledGrammar, FormatError, GrammarCache, grammar_vocab
from localspec.engine.stats import GenerationStats
from localspec.errors import PresetError, RequestError
from localspec.models.cache import Progress
from localspec.models.loading import LoadedModel, check_same_tokenizer, load_model
from localspec.output_format import OutputFormat
from localspec.registry import drafter_spec
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams


def request_settings_for(preset: Preset, **overrides: object) -> RequestSettings:
    """The preset's request settings, any of them overridden by keyword (None keeps the
    preset's), validated against ``localspec.config``'s bounds: RequestError names the setting
    (NaN, a negative top-k, a seed beyond 64 bits, ...). Needs no model."""
    base = {**preset.sampling.model_dump(),
            "num_speculative_tokens": preset.speculative_config.num_speculative_tokens,
            "adaptive": preset.localspec.adaptive_k, "tree_width": preset.localspec.tree_width}
    unknown = set(overrides) - set(base)
    if unknown:
        raise TypeError(f"unknown request settings: {', '.join(sorted(unknown))}")
    return request_settings(base, overrides)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    events: list[StepEvent]
    stats: GenerationStats
    finish_reason: str | None


@dataclass
class Pipeline:
    """Models of one preset, loaded once, and an engine per speculative method; the
    ``BuildContext`` each method's registered build is given."""

    preset: Preset
    target: LoadedModel
    draft: LoadedModel | None
    _engines: dict[str, SpeculativeEngine] = field(default_factory=dict)
    _runner: ModelRunner | None = None
    _grammars: GrammarCache | None = None
    _slots: dict[int, PipelineSlot] = field(default_factory=dict)
    # the user's earlier answers, in the target's tokens (the suffix drafter's global index):
    # empty until the caller that owns conversations fills it (``remember``)
    history: AnswerHistory = field(default_factory=lambda: AnswerHistory(HISTORY_DRAFT_TOKENS))

    @classmethod
    def load(cls, preset: Preset, progress: Progress | None = None, load_draft: bool = True,
             previous: Pipeline | None = None) -> Pipeline:
        """Load the preset's models, reusing ``previous``'s target/draft where the spec matches
        (switching only the drafter must not reload a 1.5B target), and its history of
        answers with its target."""
        kwargs = {} if progress is None else {"progress": progress}
        loaded: dict[ModelSpec, LoadedModel] = {}
        if previous is not None:
            loaded[previous.preset.target_spec()] = previous.target
            if previous.draft is not None and (spec := previous.preset.draft_spec()) is not None:
                loaded[spec] = previous.draft

        def get(spec: ModelSpec, share_tokenizer: LoadedModel | None = None) -> LoadedModel:
            if spec not in loaded:
                loaded[spec] = load_model(spec, share_tokenizer=share_tokenizer, **kwargs)
            return loaded[spec]

        target = get(preset.target_spec())
        draft_spec = preset.draft_spec()
        draft = None
        if draft_spec is not None and load_draft:
            draft = get(draft_spec, share_tokenizer=target)
            check_same_tokenizer(target, draft)
        pipe = cls(preset, target, draft)
        if previous is not None and previous.target is target:  # same tokens: same history
            pipe.history = previous.history
        return pipe

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    def eos_token_ids(self) -> set[int]:
        ids = set()
        eos = self.target.model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode_chat(self, messages: list[dict[str, object]],
                    tools: list[dict[str, object]] | None = None) -> list[int]:
        """Messages through the model's chat template, ready for the assistant's answer; with
        ``tools`` (OpenAI's function specs), the template's own way of offering them.

        A model without a template (a base model) is a PresetError that says to use raw text;
        a template that refuses the messages (roles out of order, ...) is a RequestError with
        the template's own words."""
        if self.tokenizer.chat_template is None:
            raise PresetError(f"preset '{self.preset.name}': the target model has no chat "
                              "template (a base model?): use raw text (--raw) or a chat model")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                      add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as exc:
            raise RequestError(f"the model's chat template refused these messages: {exc}"
                               ) from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        if raw:
            return self.tokenizer.encode(prompt)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def target_runner(self) -> ModelRunner:
        if self._runner is None:
            self._runner = self.target.runner(logits_fp32=self.preset.localspec.logits_fp32,
                                              **self._graph_options(self.target))
            self._runner.compile_graphs()
        return self._runner

    @property
    def cuda_graphs(self) -> bool:
        """Whether the target's forwards run as CUDA graphs (compiled when its runner is
        made: the app says so while it waits)."""
        return bool(self._graph_options(self.target))

    def _graph_options(self, loaded: LoadedModel) -> dict[str, object]:
        """Static cache and CUDA graphs where the preset asks for them and the model runs
        the Hugging Face forward on a CUDA device; nothing otherwise (a GPU preset run on a
        CPU falls back to the usual cache)."""
        if not (self.preset.localspec.cuda_graphs and loaded.decoder is None
                and loaded.model.device.type == "cuda"):
            return {}
        limit = int(getattr(loaded.model.config, "max_position_embeddings", 0) or 0)
        return {"static_cache": min(DEFAULT_CONTEXT, limit) if limit else DEFAULT_CONTEXT,
                "cuda_graphs": True}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def draft_vocab_size(self) -> int:
        """Rows of the draft model's LM head (``BuildContext``)."""
        return self._loaded_draft().vocab_size

    def draft_runner(self, vocab_rows: torch.Tensor | None = None) -> ModelRunner:
        """A new runner of the draft model, LM head cut to ``vocab_rows``, its graphs compiled
        where the preset asks for them (``BuildContext``)."""
        draft = self._loaded_draft()
        runner = draft.runner(vocab_rows=vocab_rows, **self._graph_options(draft))
        runner.compile_graphs()
        return runner

    def answer_history(self) -> AnswerHistory | None:
        """The earlier answers a history drafter reads (``BuildContext``); None when the
        preset turns history drafts off."""
        return self.history if self.preset.localspec.history_drafts else None

    def remember(self, answers: list[list[int]], prompts: list[list[int]] | None = None
                 ) -> int:
        """Learn finished answers' tokens, oldest first, each after the end of its prompt
        where ``prompts`` gives them, unless the preset turns history drafts off; how many
        were taken."""
        if not self.preset.localspec.history_drafts or not answers:
            return 0
        self.history.extend(answers, prompts)
        return len(answers)

    def _loaded_draft(self) -> LoadedModel:
        if self.draft is None:
            raise PresetError(f"a drafter asked for the draft model, and this pipeline of "
                              f"preset '{self.preset.name}' was loaded without one")
        return self.draft

    def _build_drafter(self, name: str, ctx: BuildContext | None = None) -> Drafter:
        """Registered drafter ``name``, made by its registered build with ``ctx`` (default:
        this pipeline) as its ``BuildContext``."""
        spec = drafter_spec(name)
        if spec.build is None:
            raise ValueError(f"method '{name}' is not a drafter")
        if spec.needs == "draft_model" and self.draft is None:
            raise PresetError(f"method '{name}' needs a draft model, and this pipeline of "
                              f"preset '{self.preset.name}' was loaded without one")
        module, _, function = spec.build.partition(":")
        build: Callable[[BuildContext], Drafter] = getattr(importlib.import_module(module),
                                                           function)
        return build(self if ctx is None else ctx)

    def slot(self, index: int) -> PipelineSlot:
        """Parallel slot ``index`` (``localspec serve --parallel``): its own target runner and
        drafters (their KV caches) over this pipeline's models, whose weights all slots share.
        Slot 0 is the pipeline's own runner and engines (the app's and a lone request's)."""
        if index < 0:
            raise ValueError(f"a slot's index is >= 0, got {index}")
        if index not in self._slots:
            self._slots[index] = PipelineSlot(self, index)
        return self._slots[index]

    def engine(self, method: str | DrafterSet | None = None) -> SpeculativeEngine:
        """The engine for ``method`` (default: the preset's; a name is resolved here, once),
        sharing the target's runner; made when first asked for."""
        drafters = (method if isinstance(method, DrafterSet)
                    else self.preset.drafter_set(method))
        if drafters.method not in self._engines:
            self._engines[drafters.method] = self.engine_with(
                tuple(self._build_drafter(name) for name in drafters.members))
        return self._engines[drafters.method]

    def request(self, prompt_ids: list[int], stop_strings: tuple[str, ...] = (),
                reuse_prefix: bool = False, output: OutputFormat | None = None,
                **overrides: object) -> GenerationRequest:
        """A request with the preset's settings, any of them overridden by keyword (None keeps
        the preset's); validated as ``request_settings_for`` says. ``reuse_prefix``: a chat's
        next turn, whose prompt starts with the last one's tokens (``GenerationRequest``).
        ``output``: the answer's format (structured output), compiled here once per format
        (``grammar``); a format that cannot be used raises ``FormatError``."""
        r = request_settings_for(self.preset, **overrides)
        return GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=r.max_new_tokens,
            sampling=SamplingParams(r.temperature, r.top_k, r.top_p),
            num_speculative_tokens=r.num_speculative_tokens, adaptive=r.adaptive,
            stop_strings=stop_strings, seed=r.seed, tree_width=r.tree_width,
            reuse_prefix=reuse_prefix, grammar=None if output is None else self.grammar(output))

    def grammar(self, output: OutputFormat) -> CompiledGrammar:
        """``output`` compiled for the target's tokenizer, cached by ``OutputFormat.key()``;
        the tokenizer's side is built at the first call (1-3 s for a 152k vocabulary). The end
        of a constrained answer is the tokenizer's own end token. FormatError when the format
        cannot be used (the API answers 400)."""
        if self._grammars is None:
            eos_ids = self.eos_token_ids()
            if not eos_ids:
                raise FormatError(f"preset '{self.preset.name}': the target has no end token, "
                                  "and a structured answer must be able to end")
            eos = (self.tokenizer.eos_token_id if self.tokenizer.eos_token_id in eos_ids
                   else min(eos_ids))
            self._grammars = GrammarCache(grammar_vocab(self.tokenizer, self.target.vocab_size,
                                                        eos))
        return self._grammars.get(output)

    def engine_with(self, drafters: tuple[Drafter, ...]) -> SpeculativeEngine:
        """An engine over the target's runner with ``drafters`` (none: plain decoding); not
        cached (``engine`` caches one per method)."""
        return SpeculativeEngine(self.target_runner(), drafters, self._decode,
                                 self.eos_token_ids())

    def stream(self, request: GenerationRequest, method: str | DrafterSet | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> Iterator[StepEvent]:
        return self.engine(method).generate(request, cancelled)

    def run(self, request: GenerationRequest, method: str | DrafterSet | None = None,
            on_event: Callable[[StepEvent], None] | None = None,
            engine: SpeculativeEngine | None = None) -> GenerationResult:
        """Generate to the end (with ``engine`` if given, else the method's); collect events,
        text and stats."""
        stats = GenerationStats()
        events: list[StepEvent] = []
        start = time.perf_counter()
        stream = engine.generate(request) if engine is not None else self.stream(request, method)
        for event in stream:
            events.append(event)
            stats.add(event)
            if on_event is not None:
                on_event(event)
        stats.wall_time = time.perf_counter() - start
        token_ids = [t for e in events for t in e.tokens]
        text = "".join(e.text_delta for e in events)
        finish = events[-1].finish_reason if events else None
        return GenerationResult(text, token_ids, events, stats, finish)


class PipelineSlot:
    """One parallel slot of a pipeline (``Pipeline.slot``): the ``BuildContext`` its drafters
    are made with, so that each slot's target runner, draft runner and heads keep caches of
    their own while the models' weights are the pipeline's. Slot 0 is the pipeline itself."""

    def __init__(self, pipeline: Pipeline, index: int) -> None:
        self.pipeline, self.index = pipeline, index
        self._runner: ModelRunner | None = None
        self._engines: dict[str, SpeculativeEngine] = {}

    @property
    def preset(self) -> Preset:
        return self.pipeline.preset

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.pipeline.tokenizer

    def target_runner(self) -> ModelRunner:
        if self.index == 0:
            return self.pipeline.target_runner()
        if self._runner is None:
            self._runner = self.pipeline.target.runner(
                logits_fp32=self.preset.localspec.logits_fp32)
        return self._runner

    def draft_vocab_size(self) -> int:
        return self.pipeline.draft_vocab_size()

    def draft_runner(self, vocab_rows: torch.Tensor | None = None) -> ModelRunner:
        return self.pipeline.draft_runner(vocab_rows)

    def answer_history(self) -> AnswerHistory | None:
        return self.pipeline.answer_history()  # one history for every slot

    def engine(self, method: str | DrafterSet | None = None) -> SpeculativeEngine:
        """This slot's engine for ``method`` (as ``Pipeline.engine``), made when first asked."""
        if self.index == 0:
            return self.pipeline.engine(method)
        drafters = (method if isinstance(method, DrafterSet)
                    else self.preset.drafter_set(method))
        if drafters.method not in self._engines:
            built = tuple(self.pipeline._build_drafter(name, self) for name in drafters.members)
            self._engines[drafters.method] = SpeculativeEngine(
                self.target_runner(), built, self.pipeline._decode,
                self.pipeline.eos_token_ids())
        return self._engines[drafters.method]
