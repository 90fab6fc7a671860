"""``localspec train-drafter``: train an EAGLE, EAGLE-3 or Medusa head for a target, here
(any method whose registry entry names a trainer: ``training.heads.head_trainer``).

Phases, each bounded by a flag and announced with its size before it starts (and with a time
estimate once its first few units are measured): the corpus (``--tokens``), the frozen target's
features over it (cached on disk, reused by later runs), the head's training (``--steps``
batches of ``--batch`` chunks of ``--seq-len`` tokens), saving it where a preset can name it,
and the acceptance it reaches on held-out prompts (``--eval-prompts`` x ``--eval-tokens``).

Everything a flag or a file can get wrong (an unknown method, no target, a missing or empty
corpus, an output folder that cannot be written, a checkpoint to resume that is missing or
belongs to other settings) is a LocalSpecError, found before the expensive phase it would spoil:
most before any model loads.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from localspec.cli.loading import ProgressBar, load_pipeline
from localspec.config import Preset, parse_preset
from localspec.errors import ConfigError, InputFileError
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.registry import trainable_methods
from localspec.training.answers import SelfDistiller, open_answers
from localspec.training.corpus import (
    Corpus,
    Document,
    build_corpus,
    default_documents,
    encoders,
)
from localspec.training.corpus import user_documents as read_corpus
from localspec.training.evaluate import measure_acceptance
from localspec.training.features import extract_features, open_store
from localspec.training.heads import (
    HeadShape,
    feature_layers,
    head_bytes,
    head_config,
    head_trainer,
    initial_head,
    new_head,
    save_head,
    vocabulary,
    vocabulary_coverage,
)
from localspec.training.target import FrozenTarget, fingerprint
from localspec.training.train import Checkpoint, TrainConfig, train

Log = Callable[[str], None]


@dataclass(frozen=True)
class TrainPlan:
    """What ``train-drafter`` will do, checked before any model loads."""

    preset: Preset  # its target is the one trained for
    method: str
    out: Path
    documents: Iterable[Document] | None  # None: the standard library, read lazily
    shape: HeadShape
    config: TrainConfig
    resume: bool


def _target_preset(args: argparse.Namespace) -> Preset:
    """The preset whose target is trained for: ``--preset`` (its quantization included), its
    model replaced by ``--target``, or ``--target`` alone with default settings."""
    if args.preset:
        preset = load_preset(args.preset)
        if args.target:
            target = preset.target.model_copy(update={"model": args.target})
            preset = preset.model_copy(update={"target": target})
        return preset
    if not args.target:
        raise ConfigError("train-drafter needs the target: --target MODEL, or --preset PRESET "
                          "to train on its target as it is served (e.g. --preset "
                          "cpu-qwen-coder-draft: the default model in w8a8)")
    return parse_preset({"name": f"train-drafter {args.target}", "description": "target only",
                         "hardware": "cpu", "target": {"model": args.target}})


def _writable_folder(out: str) -> Path:
    folder = Path(out).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".localspec-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputFileError(f"--out {out}: cannot write there ({exc.strerror or exc})") from exc
    return folder


def plan_training(args: argparse.Namespace) -> TrainPlan:
    """Check flags, files and the checkpoint; no model is loaded."""
    if args.method not in trainable_methods():
        raise ConfigError(f"unknown --method '{args.method}': choose one of "
                          f"{', '.join(trainable_methods())}")
    if args.answers == "target" and args.format == "raw":
        raise ConfigError("--answers target needs requests to answer: it works with the chat "
                          "format, not --format raw")
    preset = _target_preset(args)
    documents = (read_corpus(args.corpus, answered=args.answers == "corpus") if args.corpus
                 else None)
    out = _writable_folder(args.out)
    checkpoint = Checkpoint(out / "checkpoint")
    if args.resume and not checkpoint.exists:
        raise InputFileError(f"--resume: {checkpoint.folder} holds no checkpoint to resume; "
                             "run without --resume to start")
    if not args.resume and checkpoint.exists:
        step = checkpoint.read_meta().get("step")
        raise InputFileError(f"--out {out} already holds a training checkpoint (step {step}): "
                             "add --resume to continue it, or choose another --out")
    if args.resume:
        trained = checkpoint.read_meta().get("identity", {}).get("method")
        if trained != args.method:
            raise InputFileError(f"cannot resume from {checkpoint.folder}: it trains a "
                                 f"{trained} head and this run asks for --method "
                                 f"{args.method}; use another --out")
    shape = HeadShape(args.intermediate_size or 0, args.attention_heads, args.draft_vocab,
                      args.heads, args.medusa_layers)
    config = TrainConfig(args.method, args.steps, args.batch, args.lr, unroll=args.unroll,
                         seed=args.seed, checkpoint_every=args.checkpoint_every)
    return TrainPlan(preset, args.method, out, documents, shape, config, args.resume)


def command_line(args: argparse.Namespace) -> str:
    """The command with every setting spelled out, defaults included (the training budget)."""
    words = ["localspec", "train-drafter"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key in ("func", "command", "json") or value is None or value is False:
            continue
        words += [flag] if value is True else [flag, *map(str, value if isinstance(
            value, list) else [value])]
    return shlex.join(words)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Setup:
    """The loaded target, the corpus and the untrained head: everything before the phases
    that take minutes."""

    pipe: Pipeline
    target: FrozenTarget
    fmt: str
    corpus: Corpus
    layers: tuple[int, ...]
    vocab_ids: torch.Tensor
    head: torch.nn.Module
    identity: dict[str, object]  # what a checkpoint must match to be resumed
    fingerprint: dict[str, object]  # the served target's: keys the feature and answer caches
    distiller: SelfDistiller | None  # --answers target


def _set_up(plan: TrainPlan, args: argparse.Namespace, log: Log) -> Setup:
    """Load the target, read and encode the corpus, build the head, and check a checkpoint
    to resume against it (before any target pass is spent)."""
    distill = args.answers == "target"
    pipe = load_pipeline(plan.preset, need_draft=distill)  # the draft answers sooner
    runner = pipe.target_runner()
    target = FrozenTarget(runner)
    spec = plan.preset.target_spec()
    served = fingerprint(spec, pipe.target.folder, str(target.device),
                         plan.preset.localspec.logits_fp32)
    fmt = args.format
    if fmt == "auto":
        fmt = "chat" if pipe.tokenizer.chat_template else "raw"
    if fmt == "chat" and not pipe.tokenizer.chat_template:
        raise ConfigError(f"--format chat{' (--answers target)' if distill else ''}: the "
                          "target has no chat template (a base model?): use --format raw")
    if runner.max_length and args.seq_len > runner.max_length:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the target's context "
                          f"({runner.max_length} tokens)")
    layers = feature_layers(plan.method, runner.num_layers)
    encode, prompt_ids = encoders(pipe.tokenizer, fmt)
    distiller = None
    if distill:
        distiller = SelfDistiller(pipe, open_answers(served, args.answer_tokens),
                                  args.answer_tokens, log)
        log(f"answers: the target's own, at most {args.answer_tokens} tokens each "
            f"({len(distiller.cache)} cached in {distiller.cache.path})")
        written = encode
        encode = lambda document: written(distiller(document))  # noqa: E731
    corpus = build_corpus(plan.documents or default_documents(), encode, prompt_ids,
                          args.tokens, args.seq_len, args.eval_prompts)
    vocab_ids, coverage = vocabulary(corpus.chunks, target.vocab_size, plan.shape.draft_vocab)
    if args.init:
        head, vocab_ids = initial_head(args.init, plan.method, target, layers, vocab_ids)
        coverage = vocabulary_coverage(corpus.chunks, target.vocab_size, vocab_ids)
    else:
        head = new_head(plan.method, target, plan.shape, vocab_ids, plan.config.seed)
    identity = {**plan.config.identity(), "seq_len": len(corpus.chunks[0]),
                "layers": list(layers), "head": head_config(head, plan.method, layers, ""),
                "target": [spec.model, spec.dtype, spec.quantization]}
    if plan.resume:
        Checkpoint(plan.out / "checkpoint").check(identity)
    tokens = sum(len(c) for c in corpus.chunks)
    source = " ".join(args.corpus) if args.corpus else "the Python standard library"
    if distiller is not None:
        source += (f", answered by the target ({distiller.made} answers made, "
                   f"{distiller.reused} cached)")
    head_mb = head_bytes(head, target.vocab_size) / 1e6
    log(f"corpus: {tokens:,} tokens from {corpus.documents} documents of {source} ({fmt}"
        f"{', all of it' if corpus.exhausted else ''}), {len(corpus.chunks)} chunks of "
        f"{len(corpus.chunks[0])}; {len(corpus.eval_prompts)} documents held out")
    role = head_trainer(plan.method).vocabulary_role
    log(f"head: {plan.method}, {head_mb:.1f} MB as bfloat16; its {role} of "
        f"{len(vocab_ids):,} tokens covers {coverage:.1%} of the corpus")
    log(f"plan: target features for {tokens:,} tokens (cached ones reused), "
        f"{plan.config.steps} steps of {plan.config.batch} x {len(corpus.chunks[0])} tokens, "
        f"acceptance on {len(corpus.eval_prompts)} prompts x {args.eval_tokens} tokens")
    return Setup(pipe, target, fmt, corpus, layers, vocab_ids, head, identity, served,
                 distiller)


def run_train_drafter(args: argparse.Namespace, log: Log) -> int:
    """Validate, load, compute features, train, save, measure; print a summary."""
    plan = plan_training(args)
    began = time.perf_counter()
    s = _set_up(plan, args, log)
    spec = plan.preset.target_spec()
    checkpoint = Checkpoint(plan.out / "checkpoint")
    progress = ProgressBar()
    try:
        store = open_store(s.fingerprint, s.layers, s.target.hidden_size)
        extracted = extract_features(s.target.runner, s.layers, s.corpus.chunks, store,
                                     progress, log)
        result, vocab_ids = train(s.head, s.target, store, extracted.paths, s.vocab_ids,
                                  plan.config, checkpoint, s.identity, plan.resume, progress,
                                  log)
        saved_bytes = save_head(s.head, plan.method, plan.out, s.layers, spec.model,
                               s.target.vocab_size)
        acceptance = None
        if s.corpus.eval_prompts:
            acceptance = measure_acceptance(plan.preset, s.pipe.target, plan.method, plan.out,
                                            s.corpus.eval_prompts, args.eval_tokens,
                                            args.eval_k, progress)
    finally:
        progress.close()
    report = {
        "method": plan.method, "out": str(plan.out), "target": spec.model,
        "quantization": spec.quantization, "head_bytes": saved_bytes, "format": s.fmt,
        "corpus": args.corpus or "stdlib", "documents": s.corpus.documents,
        "answers": None if s.distiller is None else {
            "source": "target", "max_tokens": args.answer_tokens, "made": s.distiller.made,
            "reused": s.distiller.reused, "tokens_made": s.distiller.tokens,
            "seconds": round(s.distiller.seconds, 1)},
        "init": args.init,
        "tokens": sum(len(c) for c in s.corpus.chunks), "chunks": len(s.corpus.chunks),
        "seq_len": len(s.corpus.chunks[0]), "draft_vocab": len(vocab_ids),
        "features": {"computed": extracted.computed, "reused": extracted.reused,
                     "seconds": round(extracted.seconds, 2)},
        "training": {"start_step": result.start_step, "end_step": result.end_step,
                     "batch": plan.config.batch, "first_loss": _mean(result.losses[:5]),
                     "last_loss": _mean(result.losses[-5:]), "losses": result.losses,
                     "accuracy": round(result.accuracy, 4), "seconds": round(result.seconds, 2)},
        "acceptance": None if acceptance is None else acceptance.as_dict(),
        "wall_seconds": round(time.perf_counter() - began, 1),
        "command": command_line(args),
    }
    (plan.out / "training.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(json.dumps(report) if args.json else summary(report))
    return 0


def summary(report: dict[str, Any]) -> str:
    """The report as a few lines for people."""
    t, a = report["training"], report["acceptance"]
    lines = [f"saved {report['method']} head: {report['out']} "
             f"({report['head_bytes'] / 1e6:.1f} MB)"]
    if t["losses"]:
        lines.append(f"loss {t['first_loss']:.3f} -> {t['last_loss']:.3f} over steps "
                     f"{t['start_step']}..{t['end_step']} (first-token top-1 "
                     f"{t['accuracy']:.0%})")
    else:
        lines.append(f"already trained for {t['end_step']} steps: raise --steps to go on")
    if a is not None:
        positions = " ".join(f"{p:.0%}" for p in a["per_position"])
        lines.append(f"acceptance on {a['prompts']} held-out prompts: "
                     f"{a['mean_accepted_length']:.2f} tokens per target pass at k={a['k']} "
                     f"(drafts accepted {a['acceptance_rate']:.0%}; by position {positions})")
    lines.append(f'use it: [speculative_config] method = "{report["method"]}", '
                 f'model = "{report["out"]}"')
    return "\n".join(lines)
