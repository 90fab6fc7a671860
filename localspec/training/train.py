"""The training loop: AdamW on the head alone, over batches of cached chunks, with checkpoints
that a later run resumes exactly.

Each step draws ``batch`` chunks with a generator seeded by (seed, step) on the target's device,
so a resumed run sees the batches the uninterrupted run would have seen; the checkpoint holds
the head's float32 weights, AdamW's moments and the training vocabulary (``checkpoint/`` in the
output folder: ``state.safetensors`` and ``state.json``). Resuming with other settings than
those that shaped the head or its data (method, sizes, target, layers, batch, learning rate,
unroll, seed, chunk length) is refused, naming the first that differs; ``--steps`` may grow.
Ctrl-C saves a checkpoint at the last finished step before it stops.

The learning rate warms up over the first tenth of the steps (at most 20) and then follows a
cosine down to a tenth of its peak at ``steps``. The target and its LM head are never updated:
only the head's parameters are given to the optimizer.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from localspec.errors import InputFileError
from localspec.models.cache import Progress, no_progress
from localspec.training.features import FeatureStore
from localspec.training.heads import head_trainer
from localspec.training.losses import IGNORE
from localspec.training.pace import Pace
from localspec.training.target import FrozenTarget

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class TrainConfig:
    """How the head is trained; everything but ``steps`` and the logging cadence must match
    on resume."""

    method: str
    steps: int
    batch: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.01
    unroll: int = 3  # EAGLE training-time-test steps beyond the first
    seed: int = 0
    checkpoint_every: int = 25
    log_every: int = 10

    def identity(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items()
                if k not in ("steps", "checkpoint_every", "log_every")}

    def lr_at(self, step: int) -> float:
        warmup = max(1, min(20, self.steps // 10))
        if step < warmup:
            return self.lr * (step + 1) / warmup
        done = (step - warmup) / max(1, self.steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


@dataclass
class TrainResult:
    start_step: int
    end_step: int
    losses: list[float] = field(default_factory=list)  # this run's, one per step
    accuracy: float = 0.0  # top-1 of the first draft token, last step
    seconds: float = 0.0


@dataclass(frozen=True)
class Checkpoint:
    """A saved training state in ``folder``."""

    folder: Path

    @property
    def exists(self) -> bool:
        return (self.folder / "state.json").is_file()

    def read_meta(self) -> dict[str, object]:
        path = self.folder / "state.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputFileError(f"cannot resume: {path} is unreadable ({exc}); start over in "
                                 "a new --out folder") from exc
        if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
            raise InputFileError(f"cannot resume: {path} is not a checkpoint this version "
                                 "writes; start over in a new --out folder")
        return meta

    def check(self, identity: dict[str, object]) -> dict[str, object]:
        """The checkpoint's metadata; InputFileError naming the first setting that differs."""
        saved = self.read_meta().get("identity", {})
        for key, value in identity.items():
            if saved.get(key) != value:
                raise InputFileError(
                    f"cannot resume from {self.folder}: it was trained with {key} = "
                    f"{_short(saved.get(key))} and this run asks for {_short(value)}. Run with "
                    "the checkpoint's settings, or start over without --resume in a new --out")
        return self.read_meta()

    def save(self, head: torch.nn.Module, optimizer: torch.optim.Optimizer,
             vocab_ids: torch.Tensor, step: int, identity: dict[str, object]) -> None:
        tensors = {f"head.{n}": t.detach().cpu().contiguous()
                   for n, t in head.state_dict().items()}
        tensors["vocab"] = vocab_ids.cpu()
        names = _trained_names(head)
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                tensors[f"adam.{names[index]}.{key}"] = value.detach().cpu().contiguous()
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.folder / "state.safetensors.tmp"
        save_file(tensors, temporary)
        temporary.replace(self.folder / "state.safetensors")
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "identity": identity}
        (self.folder / "state.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")

    def load(self, head: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Restore head and optimizer in place; the training vocabulary."""
        try:
            tensors = load_file(self.folder / "state.safetensors")
        except (SafetensorError, OSError) as exc:
            raise InputFileError(f"cannot resume: {self.folder / 'state.safetensors'} is "
                                 f"unreadable ({exc}); start over in a new --out") from exc
        head.load_state_dict({n[5:]: t for n, t in tensors.items() if n.startswith("head.")})
        state = {}
        for index, name in enumerate(_trained_names(head)):
            prefix = f"adam.{name}."
            found = {key[len(prefix):]: t for key, t in tensors.items()
                     if key.startswith(prefix) and "." not in key[len(prefix):]}
            if found:
                state[index] = found
        optimizer.load_state_dict({"state": state,
                                   "param_groups": optimizer.state_dict()["param_groups"]})
        return tensors["vocab"]


def _trained_names(head: torch.nn.Module) -> list[str]:
    """Names of the parameters given to the optimizer, in its order."""
    return [n for n, p in head.named_parameters() if p.requires_grad]


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _batch(store: FeatureStore, paths: list[Path], config: TrainConfig, step: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, T, W], ids [B, T], labels [B, T]) of step ``step``'s chunks."""
    generator = torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + step)
    if len(paths) >= config.batch:
        picks = torch.randperm(len(paths), generator=generator, device=device)[:config.batch]
    else:
        picks = torch.randint(len(paths), (config.batch,), generator=generator, device=device)
    chunks = [store.load(paths[i], device) for i in picks.tolist()]
    return (torch.stack([c.features for c in chunks]), torch.stack([c.ids for c in chunks]),
            torch.stack([c.labels for c in chunks]))


def train(head: torch.nn.Module, target: FrozenTarget, store: FeatureStore,
          paths: list[Path], vocab_ids: torch.Tensor, config: TrainConfig,
          checkpoint: Checkpoint, identity: dict[str, object], resume: bool,
          progress: Progress = no_progress,
          log: Callable[[str], None] = logger.info) -> tuple[TrainResult, torch.Tensor]:
    """Train ``head`` in place up to ``config.steps`` (from the checkpoint when ``resume``);
    the result and the training vocabulary (the checkpoint's when resumed). The loss is
    ``config.method``'s trainer's (``heads.head_trainer``)."""
    device = target.device
    trainer = head_trainer(config.method)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=BETAS,
                                  weight_decay=config.weight_decay)
    start = 0
    if resume:
        start = int(checkpoint.check(identity)["step"])
        vocab_ids = checkpoint.load(head, optimizer)
        log(f"resuming from step {start} ({checkpoint.folder})")
    to_subset = torch.full((target.vocab_size,), IGNORE, dtype=torch.long, device=device)
    to_subset[vocab_ids.to(device)] = torch.arange(len(vocab_ids), device=device)
    lm_rows = None if getattr(head, "lm_head", None) is not None else target.lm_head_rows(
        vocab_ids)
    result = TrainResult(start, start)
    began = time.perf_counter()
    name = f"training {config.method} head"
    pace = Pace("training", "step", config.steps - start, log)
    head.train()
    try:
        for step in range(start, config.steps):
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            features, ids, labels = _batch(store, paths, config, step, device)
            loss, accuracy = trainer.loss(head, target, features, ids, labels, lm_rows,
                                          to_subset, config.unroll)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
            result.losses.append(float(loss.detach()))
            result.accuracy, result.end_step = accuracy, step + 1
            progress(name, (step + 1 - start) / (config.steps - start))
            pace.done(step + 1 - start)
            if (step + 1) % config.log_every == 0:
                log(f"step {step + 1}/{config.steps}: loss {result.losses[-1]:.3f}, first-token "
                    f"top-1 {accuracy:.0%}")
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                checkpoint.save(head, optimizer, vocab_ids, step + 1, identity)
    except KeyboardInterrupt:
        if result.end_step > start:
            checkpoint.save(head, optimizer, vocab_ids, result.end_step, identity)
            log(f"interrupted: checkpoint at step {result.end_step} saved in "
                f"{checkpoint.folder}; run again with --resume to continue")
        raise
    result.seconds = time.perf_counter() - began
    head.eval()
    return result, vocab_ids
