"""New draft heads for a target: their shape, first weights, size, and the files the drafters'
loaders read (``localspec.drafters.head_layouts``).

What a head method does here is its ``HeadTrainer``, named by its registry entry
(``registry.HeadSpec.trainer``) and imported by ``head_trainer``: the functions below read no
method names, so a head method registered elsewhere (a test's toy) trains the same way. The
shipped trainers are ``training.eagle_trainer`` (EAGLE, EAGLE-3) and ``training.medusa_trainer``.

Shapes, sized for a budget (the head shipped for the bundled 1.5B must be <= 40 MB):

- ``eagle``: ``fc`` [h, 2h], one decoder layer with ``attention_heads`` heads of the target's
  head size and an MLP of ``intermediate_size``; read through the target's own LM head.
- ``eagle3``: ``fc`` [h, 3h] over three target layers, the same layer (its attention reads 2h),
  a norm and an LM head over a reduced draft vocabulary: the ``draft_vocab`` most frequent
  tokens of the corpus, mapped to the target's ids by ``d2t`` (EAGLE-3's published form).
- ``medusa``: ``medusa_heads`` residual blocks on the last hidden state, all read through the
  target's LM head cut to the ``draft_vocab`` most frequent tokens of the corpus, listed in
  ``token_map`` (vLLM's truncated vocabulary; a Medusa LM head of its own would be [vocab, h]:
  467 MB for the 1.5B).

For the 1.5B (h = 1536, 151,936 tokens) the defaults make eagle3 39.5 MB, eagle 37.8 MB and
medusa 18.9 MB in bfloat16 (3 heads: 14.2 MB). Fewer attention heads than the target's 12 is
what makes room for a useful draft vocabulary: ``fc`` alone is 14 MB.

First weights, drawn from an explicit generator on the target's device: ``fc`` passes the
feature through (identity on the feature's block, small noise elsewhere), the layer's outputs
start small, and EAGLE-3's norm and LM head start as the target's final norm and LM head rows,
so the untrained head already speaks the target's output space. Medusa blocks start as the
identity (Medusa's own choice). Heads are saved as bfloat16 safetensors and config.json.

``--init HEAD`` starts from a trained head instead (to train it further, e.g. on the target's
own answers): read by the drafters' own loader, so a head for another target is refused with
the same message, then made float32 and trainable. Its sizes and (EAGLE-3) draft vocabulary
are kept; a head that fuses other layers than this run's features is refused.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from torch import nn

from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_head
from localspec.errors import ConfigError, ModelLoadError
from localspec.registry import drafter_spec
from localspec.training.target import FrozenTarget

SAVE_DTYPE = torch.bfloat16
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class HeadShape:
    """Sizes a user may set; 0 means the default for the method and target."""

    intermediate_size: int = 0
    attention_heads: int = 4
    draft_vocab: int = 4096  # EAGLE-3's LM head rows; the others' training softmax rows
    medusa_heads: int = 4
    medusa_layers: int = 1

    def intermediate(self, ratio: float, hidden: int) -> int:
        """The MLP width: the user's, else ``ratio`` x ``hidden`` rounded to 16."""
        if self.intermediate_size:
            return self.intermediate_size
        return max(16, round(hidden * ratio / 16) * 16)


class HeadTrainer(Protocol):
    """What ``train-drafter`` needs of a head method (its ``HeadSpec.trainer``)."""

    @property
    def vocabulary_role(self) -> str:
        """What the training vocabulary is to the head, for the log ("draft vocabulary")."""
        ...

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers the head reads (runner numbering: ``num_layers`` is the final
        normed state); ConfigError when the target cannot give them."""
        ...

    def new_head(self, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
                 seed: int) -> nn.Module:
        """An untrained float32 head on the target's device, drawn from ``seed`` alone."""
        ...

    def trained_vocabulary(self, head: nn.Module, vocab_ids: torch.Tensor) -> torch.Tensor:
        """A loaded head's own training vocabulary, else ``vocab_ids``."""
        ...

    def loss(self, head: nn.Module, target: FrozenTarget, features: torch.Tensor,
             ids: torch.Tensor, labels: torch.Tensor, lm_rows: torch.Tensor | None,
             to_subset: torch.Tensor, unroll: int) -> tuple[torch.Tensor, float]:
        """(loss, top-1 accuracy of the first draft token) of a batch (``training.losses``'
        indexing; ``lm_rows`` None when the head has an LM head of its own)."""
        ...

    def published_tensors(self, head: nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
        """The head's tensors on the CPU under the names its loader reads."""
        ...

    def config(self, head: nn.Module, layers: tuple[int, ...],
               target_name: str) -> dict[str, object]:
        """config.json as its loader and ``registry.head_method`` read it."""
        ...


def head_trainer(method: str) -> HeadTrainer:
    """The trainer ``method``'s registry entry names; ConfigError if it has none."""
    head = drafter_spec(method).head
    if head is None or head.trainer is None:
        raise ConfigError(f"method '{method}' has no head train-drafter can train")
    module, _, name = head.trainer.partition(":")
    trainer: HeadTrainer = getattr(importlib.import_module(module), name)
    return trainer


def feature_layers(method: str, num_layers: int) -> tuple[int, ...]:
    """The target layers a head of ``method`` reads (runner numbering: ``num_layers`` is the
    final normed state); ConfigError when the target is too shallow for it."""
    return head_trainer(method).feature_layers(num_layers)


def vocabulary(chunks: list[list[int]], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent token ids of the corpus, ascending, and the share of the
    corpus' tokens they cover (ties broken by id: the same list every run)."""
    counts = _counts(chunks, vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices[:min(size, vocab_size)]
    ids = order.sort().values
    return ids, vocabulary_coverage(chunks, vocab_size, ids, counts)


def _counts(chunks: list[list[int]], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([t for c in chunks for t in c]), minlength=vocab_size)


def vocabulary_coverage(chunks: list[list[int]], vocab_size: int, ids: torch.Tensor,
                        counts: torch.Tensor | None = None) -> float:
    """The share of the corpus' tokens that are among ``ids``."""
    counts = _counts(chunks, vocab_size) if counts is None else counts
    return float(counts[ids.cpu()].sum()) / max(1, int(counts.sum()))


def new_head(method: str, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
             seed: int) -> nn.Module:
    """An untrained float32 head for ``target`` on its device (see the module docstring)."""
    return head_trainer(method).new_head(target, shape, vocab_ids, seed)


def initial_head(name: str, method: str, target: FrozenTarget, layers: tuple[int, ...],
                 vocab_ids: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """The trained head ``name`` as a float32 head to train further, and its training
    vocabulary (its own draft vocabulary if it has one: EAGLE-3's, Medusa's ``token_map``;
    otherwise ``vocab_ids``)."""
    head, reads = load_head(read_head(name), method, target.runner, torch.float32)
    if tuple(reads) != tuple(layers):
        raise ModelLoadError(f"--init {name}: it fuses target layers {list(reads)}, "
                             f"this run trains on layers {list(layers)}")
    vocab_ids = head_trainer(method).trained_vocabulary(head, vocab_ids)
    head.requires_grad_(True)
    if getattr(head, "embed_tokens", None) is not None:  # a published head's own: kept
        head.embed_tokens.requires_grad_(False)
    return head.train(), vocab_ids


def saved_tensors(head: nn.Module, method: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names, floats in ``SAVE_DTYPE``."""
    tensors = head_trainer(method).published_tensors(head, vocab_size)
    return {name: (value.to(SAVE_DTYPE) if value.is_floating_point() else value).contiguous()
            for name, value in tensors.items()}


def size_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def head_bytes(head: nn.Module, vocab_size: int) -> int:
    """What ``save_head`` will write, from the shapes alone (a head on the "meta" device
    sizes a budget without allocating it): floats as ``SAVE_DTYPE``, EAGLE-3's t2d as bools."""
    total = 0
    for tensor in head.state_dict().values():
        size = SAVE_DTYPE.itemsize if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * size
    return total + (vocab_size if getattr(head, "lm_head", None) is not None else 0)


def head_config(head: nn.Module, method: str, layers: tuple[int, ...],
                target_name: str) -> dict[str, object]:
    """config.json as the published heads of ``method`` spell it."""
    return head_trainer(method).config(head, layers, target_name)


def save_head(head: nn.Module, method: str, folder: Path, layers: tuple[int, ...],
              target_name: str, vocab_size: int) -> int:
    """Write config.json and ``WEIGHTS_FILE`` into ``folder``; the weights' size in bytes."""
    tensors = saved_tensors(head, method, vocab_size)
    config = head_config(head, method, layers, target_name)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    save_file(tensors, folder / WEIGHTS_FILE)
    return size_bytes(tensors)
