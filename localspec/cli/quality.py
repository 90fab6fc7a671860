"""``localspec quality``: how closely the served target follows a reference target.

Speculative decoding is lossless with respect to the target it serves, but a quantized target
(int8 weights, bnb 4/8-bit) is not the model that was trained: its greedy choices and its
probabilities drift. This command measures that drift, teacher-forced over held-out text: both
models read the same tokens, and at every position we compare the served target's argmax with
the reference's (top-1 agreement) and the probability each gives to the real next token
(perplexity). The reference is by default the same preset's target with no quantization in
bfloat16 (``--against`` names another preset instead). Goals: agreement >= 97 % and perplexity
at most 1 % higher than the reference's.

Why teacher forcing rather than comparing generations: a generation diverges at its first
differing token and says nothing after it; teacher forcing scores every position of the text.

Only one model is in memory at a time (two 1.5B models need not fit together): each model reads
every text, keeps two numbers per position (argmax, log-probability of the next token) and is
freed before the other loads. The texts are fed in chunks through the runner's KV cache, exactly
as the engine feeds a prompt, so the scores are those of the served runner (``logits_fp32``
included).

It does not generate, sample or change any model; it only reads logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from localspec.cli.loading import load_pipeline
from localspec.config import Preset, unquantized_target
from localspec.errors import ConfigError, InputFileError, PresetError
from localspec.files import read_user_text
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import ROW_ATTENTION_MAX

AGREEMENT_GOAL = 0.97  # top-1 agreement, at least
PERPLEXITY_INCREASE_GOAL_PCT = 1.0  # perplexity above the reference's, at most
MAX_TOKENS_LIMIT = 1_000_000
# tokens per forward: bounds the [chunk, vocab] logits (78 MB for Qwen), and at most
# ROW_ATTENTION_MAX so that a CPU-path target runs the path decoding runs (the native stack)
CHUNK_TOKENS = ROW_ATTENTION_MAX
BUILTIN_TEXTS = ("python_textwrap.py.txt", "prose_python_docs.txt")

Loader = Callable[..., Pipeline]  # load_pipeline(preset, need_draft=False)


@dataclass(frozen=True)
class Text:
    """One held-out text: a short name for the table and its content."""

    name: str
    content: str


@dataclass(frozen=True)
class Scores:
    """One model teacher-forced over one text: position i predicts token i + 1."""

    token_ids: list[int]  # the tokens read (the first is only context, the others are scored)
    argmax: torch.Tensor  # [n - 1] int64: the model's top-1 token at each position
    logprob: torch.Tensor  # [n - 1] float32: log-probability of the real next token

    def cut(self, n_tokens: int) -> Scores:
        """The scores of the first ``n_tokens`` tokens only."""
        return Scores(self.token_ids[:n_tokens], self.argmax[: n_tokens - 1],
                      self.logprob[: n_tokens - 1])


@dataclass(frozen=True)
class QualityPlan:
    """What ``quality`` will compare, validated before any model loads."""

    served: Preset
    reference: Preset
    texts: list[Text]
    max_tokens: int
    same_model: bool  # the reference would load the very same model: score it once


def same_target(a: Preset, b: Preset) -> bool:
    """Whether both presets load the same target model and score it the same way."""
    return a.target_spec() == b.target_spec() and a.localspec.logits_fp32 == b.localspec.logits_fp32


def read_texts(paths: Sequence[str] | None) -> list[Text]:
    """The user's text files, or the built-in ones; InputFileError for a missing, unreadable,
    non-UTF-8 or empty file (checked before any model loads)."""
    if not paths:
        folder = resources.files("localspec").joinpath("data", "quality")
        return [Text(name.removesuffix(".txt"), folder.joinpath(name).read_text("utf-8"))
                for name in BUILTIN_TEXTS]
    texts = []
    for path in paths:
        content = read_user_text(path, "text file")
        if not content.strip():
            raise InputFileError(f"{path}: the text file is empty (or only whitespace): "
                                 "nothing to score")
        texts.append(Text(Path(path).name, content))
    return texts


def plan_quality(args: argparse.Namespace) -> QualityPlan:
    """Check presets, --max-tokens and the text files; no model is loaded."""
    served = load_preset(args.preset)
    reference = load_preset(args.against) if args.against else unquantized_target(served)
    if not 2 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        raise ConfigError(f"--max-tokens must be between 2 and {MAX_TOKENS_LIMIT} (a text of "
                          f"N tokens scores N - 1 predictions), got {args.max_tokens}")
    texts = read_texts(args.text)
    return QualityPlan(served, reference, texts, args.max_tokens, same_target(served, reference))


@torch.inference_mode()
def score_ids(runner: ModelRunner, token_ids: list[int], vocab_size: int,
              chunk_tokens: int = CHUNK_TOKENS) -> Scores:
    """Teacher-force ``token_ids`` through ``runner`` in chunks; keep per-position argmax and
    next-token log-probability.

    The log-probability is over the whole LM head: the distribution the engine samples from.
    The argmax is over the first ``vocab_size`` rows (the tokenizer's): rows beyond it pad the
    head and are no token, so ids stay comparable between models whose heads are padded to
    different widths."""
    runner.reset()
    argmaxes, logprobs = [], []
    inputs = token_ids[:-1]  # the last token is only a label
    for start in range(0, len(inputs), chunk_tokens):
        chunk = inputs[start:start + chunk_tokens]
        logits = runner.forward(chunk).float()  # [len(chunk), vocab]
        labels = torch.tensor(token_ids[start + 1:start + 1 + len(chunk)], device=logits.device)
        logp = torch.log_softmax(logits, dim=-1)  # [len(chunk), vocab] float32
        logprobs.append(logp.gather(1, labels.unsqueeze(1)).squeeze(1).cpu())
        argmaxes.append(logits[:, :vocab_size].argmax(dim=-1).cpu())
    runner.reset()  # frees the KV cache
    return Scores(list(token_ids), torch.cat(argmaxes), torch.cat(logprobs))


def score_pipeline(pipe: Pipeline, texts: Sequence[Text], max_tokens: int,
                   chunk_tokens: int = CHUNK_TOKENS,
                   log: Callable[[str], None] = lambda _line: None) -> list[Scores]:
    """Every text through ``pipe``'s target runner: at most ``max_tokens`` tokens each, fewer
    if the model's context is shorter. InputFileError for a text of fewer than 2 tokens."""
    runner = pipe.target_runner()
    limit = min(max_tokens, runner.max_length) if runner.max_length else max_tokens
    if limit < max_tokens:
        log(f"the model's context is {runner.max_length} tokens: each text is cut to {limit}")
    encoded = []
    for text in texts:
        ids = pipe.tokenizer.encode(text.content)[:limit]
        if len(ids) < 2:
            raise InputFileError(f"text {text.name}: {len(ids)} token(s); at least 2 are needed "
                                 "(one to read, one to predict)")
        encoded.append(ids)
    scores = []
    for text, ids in zip(texts, encoded, strict=True):
        log(f"scoring {text.name}: {len(ids) - 1} predictions with {pipe.target.name}")
        scores.append(score_ids(runner, ids, len(pipe.tokenizer), chunk_tokens))
    return scores


def score_preset(preset: Preset, texts: Sequence[Text], max_tokens: int,
                 chunk_tokens: int = CHUNK_TOKENS, loader: Loader = load_pipeline,
                 log: Callable[[str], None] = lambda _line: None) -> list[Scores]:
    """Load ``preset``'s target alone (no draft), score the texts, free the model before
    returning, so the next model loads into the memory this one used."""
    pipe = loader(preset, need_draft=False)
    try:
        return score_pipeline(pipe, texts, max_tokens, chunk_tokens, log)
    finally:
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def align(texts: Sequence[Text], served: list[Scores], reference: list[Scores],
          reference_name: str) -> tuple[list[Scores], list[Scores]]:
    """Both score lists over the same tokens: cut to the shorter (a shorter context), and
    PresetError if the two tokenizers read a text differently (nothing comparable)."""
    out_served, out_reference = [], []
    for text, s, r in zip(texts, served, reference, strict=True):
        n = min(len(s.token_ids), len(r.token_ids))
        if s.token_ids[:n] != r.token_ids[:n]:
            raise PresetError(f"the reference target '{reference_name}' tokenizes {text.name} "
                              "differently from the served target: their perplexities are not "
                              "comparable; choose a reference from the same model family")
        out_served.append(s.cut(n))
        out_reference.append(r.cut(n))
    return out_served, out_reference


def compare_row(name: str, served: Sequence[Scores], reference: Sequence[Scores]
                ) -> dict[str, Any]:
    """Agreement and perplexities over all positions of ``served``/``reference`` (pooled)."""
    argmax_s = torch.cat([s.argmax for s in served])
    argmax_r = torch.cat([r.argmax for r in reference])
    nll_s = -torch.cat([s.logprob for s in served]).double().mean().item()
    nll_r = -torch.cat([r.logprob for r in reference]).double().mean().item()
    agreement = (argmax_s == argmax_r).double().mean().item()
    change_pct = 100.0 * (math.exp(nll_s - nll_r) - 1.0)  # ppl_s / ppl_r - 1, overflow-safe
    return {"text": name, "tokens": int(argmax_s.numel()), "agreement": agreement,
            "perplexity_reference": math.exp(nll_r), "perplexity_served": math.exp(nll_s),
            "perplexity_change_pct": change_pct,
            "meets_goal": agreement >= AGREEMENT_GOAL
            and change_pct <= PERPLEXITY_INCREASE_GOAL_PCT}


def describe_target(preset: Preset) -> str:
    t = preset.target
    quantization = "no quantization" if t.quantization == "none" else t.quantization
    return f"{t.model} ({t.dtype}, {quantization})"


def build_report(plan: QualityPlan, served: list[Scores], reference: list[Scores]
                 ) -> dict[str, Any]:
    """The JSON report: presets, goals, one row per text and the pooled "all" row."""
    rows = [compare_row(t.name, [s], [r])
            for t, s, r in zip(plan.texts, served, reference, strict=True)]
    return {"preset": plan.served.name, "served": describe_target(plan.served),
            "reference": describe_target(plan.reference), "same_model": plan.same_model,
            "goals": {"agreement_min": AGREEMENT_GOAL,
                      "perplexity_increase_max_pct": PERPLEXITY_INCREASE_GOAL_PCT},
            "texts": rows, "all": compare_row("all", served, reference)}


def format_report(report: dict[str, Any]) -> str:
    """A table: one row per text, then "all", with the goals beside."""
    goals = report["goals"]
    lines = [f"preset:    {report['preset']}", f"served:    {report['served']}",
             f"reference: {report['reference']}"]
    if report["same_model"]:
        lines.append("           (the same model, dtype and quantization: scored once, "
                     "agreement is 100% by construction)")
    lines += ["", f"{'text':24s} {'tokens':>6s} {'top-1 agree':>11s} {'ppl ref':>9s} "
              f"{'ppl served':>10s} {'ppl change':>10s}  meets goal"]
    for row in [*report["texts"], report["all"]]:
        lines.append(f"{row['text'][:24]:24s} {row['tokens']:6d} {row['agreement']:11.2%} "
                     f"{row['perplexity_reference']:9.4f} {row['perplexity_served']:10.4f} "
                     f"{row['perplexity_change_pct']:+9.2f}%  "
                     f"{'yes' if row['meets_goal'] else 'NO'}")
    lines += ["", f"goals: top-1 agreement >= {goals['agreement_min']:.0%}, perplexity "
              f"increase <= {goals['perplexity_increase_max_pct']:g}% (teacher-forced: both "
              "models read the same tokens)"]
    return "\n".join(lines)


def run_quality(args: argparse.Namespace, log: Callable[[str], None] = lambda _line: None,
                chunk_tokens: int = CHUNK_TOKENS, loader: Loader = load_pipeline) -> int:
    """Validate, score the served target, then the reference (unless it is the same model),
    print the table or one JSON object."""
    plan = plan_quality(args)
    log(f"served target: {describe_target(plan.served)}")
    served = score_preset(plan.served, plan.texts, plan.max_tokens, chunk_tokens, loader, log)
    if plan.same_model:
        reference = served
    else:
        log(f"reference target: {describe_target(plan.reference)}")
        reference = score_preset(plan.reference, plan.texts, plan.max_tokens, chunk_tokens,
                                 loader, log)
        served, reference = align(plan.texts, served, reference, plan.reference.target.model)
    report = build_report(plan, served, reference)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0
