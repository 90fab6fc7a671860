"""Target features cached on disk: one safetensors file per corpus chunk, computed once.

Why cache: the frozen target's forward costs about as much per token as a training step of
the head on a CPU (a 1.5B w8a8 pass is ~5 ms a token here), and the same features serve every
epoch and every later run: more steps, another head size, a resumed run, the other method
reading the same layers.

Layout, under ``cache_root()/features/``::

    <key>/key.json                what the key stands for (target fingerprint, layers)
    <key>/<sha256 of ids>.safetensors
        ids       [T] int32      the chunk's tokens (checked on load)
        features  [T, W] bf16    the hidden states the head reads, W = len(layers) * hidden
        labels    [T] int32      the target's greedy next token at every position

``key`` hashes the target's fingerprint (``target.fingerprint``) and the layers; a chunk file
is named by its tokens, so a corpus that changes only reuses the chunks it still has. Files are
written under a temporary name and renamed, so an interrupted run leaves no half file.
bfloat16 halves the disk (an EAGLE-3 chunk of 512 tokens of the 1.5B is 4.7 MB); the head
trains in float32 all the same. The labels are the served target's argmax: a head is scored by
whether the target accepts its drafts, not by the corpus' own next token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from localspec.config import cache_root
from localspec.errors import InputFileError
from localspec.models.cache import Progress, no_progress
from localspec.runtime.runner import ModelRunner
from localspec.training.pace import Pace

logger = logging.getLogger(__name__)

FEATURE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Chunk:
    """One chunk's cached tensors on the training device."""

    ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, W] float32
    labels: torch.Tensor  # [T] int64: the target's greedy token after position t


@dataclass(frozen=True)
class ExtractReport:
    paths: list[Path]  # one per chunk, in corpus order
    computed: int
    reused: int
    seconds: float


@dataclass(frozen=True)
class FeatureStore:
    """The cached features of one target and layer set."""

    folder: Path
    width: int  # W

    def path(self, ids: list[int]) -> Path:
        digest = hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        return self.folder / f"{digest.hexdigest()[:32]}.safetensors"

    def valid(self, path: Path, length: int) -> bool:
        """Whether ``path`` holds a whole chunk of ``length`` tokens (header only)."""
        try:
            with safe_open(path, framework="pt") as f:
                shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError):
            return False
        return shapes == {"ids": [length], "features": [length, self.width],
                          "labels": [length]}

    def save(self, ids: list[int], features: torch.Tensor, labels: torch.Tensor) -> Path:
        path = self.path(ids)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"ids": torch.tensor(ids, dtype=torch.int32),
                   "features": features.to(FEATURE_DTYPE).cpu().contiguous(),
                   "labels": labels.to(torch.int32).cpu()}, temporary)
        os.replace(temporary, path)
        return path

    def load(self, path: Path, device: torch.device) -> Chunk:
        """A chunk on ``device``; InputFileError (delete the folder) if the file is damaged."""
        try:
            tensors = load_file(path, device=str(device))
        except (SafetensorError, OSError) as exc:
            raise InputFileError(f"cached features {path} cannot be read ({exc}): delete "
                                 f"{self.folder} and run again to recompute them") from exc
        return Chunk(tensors["ids"].long(), tensors["features"].float(),
                     tensors["labels"].long())


def open_store(target: dict[str, object], layers: tuple[int, ...], hidden: int) -> FeatureStore:
    """The store for ``target`` (a fingerprint) and ``layers``, created on demand;
    InputFileError if the cache folder cannot be written."""
    key_data = {"target": target, "layers": list(layers)}
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:24]
    folder = cache_root() / "features" / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "key.json").write_text(json.dumps(key_data, indent=1), encoding="utf-8")
    except OSError as exc:
        raise InputFileError(f"cannot write the feature cache {folder}: {exc.strerror or exc}"
                             " (LOCALSPEC_CACHE moves it)") from exc
    return FeatureStore(folder, len(layers) * hidden)


def extract_features(runner: ModelRunner, layers: tuple[int, ...], chunks: list[list[int]],
                     store: FeatureStore, progress: Progress = no_progress,
                     log: Callable[[str], None] = logger.info) -> ExtractReport:
    """Run the target over every chunk not cached yet (each from an empty cache), keeping
    the features of ``layers`` and the greedy next tokens; the chunks' files, in order."""
    began = time.perf_counter()
    paths: list[Path] = []
    todo = [i for i, ids in enumerate(chunks) if not store.valid(store.path(ids), len(ids))]
    if todo:
        log(f"target features: {len(todo)} chunk(s) of {len(chunks[0])} tokens to compute, "
            f"{len(chunks) - len(todo)} cached in {store.folder}")
    runner.record_features(layers)
    pace = Pace("target features", "chunk", len(todo), log)
    done = 0
    for i, ids in enumerate(chunks):
        if done < len(todo) and todo[done] == i:
            progress("target features", done / len(todo))
            runner.reset()
            logits = runner.forward(ids)  # [T, vocab]
            paths.append(store.save(ids, runner.features(0, len(ids)), logits.argmax(-1)))
            del logits
            done += 1
            pace.done(done)
        else:
            paths.append(store.path(ids))
    runner.reset()
    progress("target features", 1.0)
    return ExtractReport(paths, len(todo), len(chunks) - len(todo),
                         time.perf_counter() - began)
