"""A toy head method, all in this one module, as a new head drafter would be in its own: the
head, its drafter and build, its loader and its trainer. ``ENTRY`` is the registry entry that
would be added to ``localspec/registry.py``; tests register it by monkeypatching
``registry.DRAFTERS`` and nothing else (``test_head_registry``).

The head: one residual linear map of the target's final state (``x + W x``, W starting at
zero), read through the target's LM head cut to ``token_map``, guessing the token after the
one the target is about to consume (Medusa's first head, cut down). Its drafter proposes that
one guess, deterministically (argmax: ``q_draft`` None), so any output stays the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from localspec.drafters.base import BuildContext
from localspec.drafters.head_files import HeadFiles, read_head
from localspec.drafters.head_layouts import load_head
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.errors import ModelLoadError
from localspec.registry import DrafterSpec, HeadSpec
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams
from localspec.training.heads import HeadShape
from localspec.training.losses import IGNORE
from localspec.training.target import FrozenTarget

METHOD = "toy-residual"
ARCHITECTURE = "ToyResidualHead"


class ToyHead(nn.Module):
    """``x + W x`` over the target's final state; ``token_map``: the LM head rows it reads."""

    def __init__(self, hidden_size: int, token_map: torch.Tensor,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.proj.weight)
        self.register_buffer("token_map", token_map.to(device=device, dtype=torch.long).clone())

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., h]: the state the target's LM head scores."""
        return feature + self.proj(feature)


class ToyDrafter(Drafter):
    """One guess a step: the head's best token after the pending one."""

    traits = DrafterTraits(METHOD)

    def __init__(self, head: ToyHead, target: ModelRunner) -> None:
        self.head, self.target = head, target
        self.layers = (target.num_layers,)
        self._logits = target.head_cut(head.token_map)
        target.record_features(self.layers)

    def reset(self, keep_cache: bool = False) -> None:
        """Ask the target (again) for its final features."""
        self.target.record_features(self.layers)

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        last = len(context) - 2  # the target holds context[:-1]
        if k <= 0 or last < 0 or self.target.length <= last:
            return Proposal([])
        feature = self.target.features(last, last + 1)  # [1, h]
        logits = self._logits(self.head(feature.to(self.head.proj.weight.dtype)))[0]
        return Proposal([int(logits.argmax())])


def build(ctx: BuildContext) -> ToyDrafter:
    """The registered build: the head named by the preset, read through the registry."""
    runner = ctx.target_runner()
    head, _ = load_head(read_head(ctx.preset.head_source()), METHOD, runner)
    assert isinstance(head, ToyHead)
    return ToyDrafter(head, runner)


def load(files: HeadFiles, target: ModelRunner, dtype: torch.dtype | None = None
         ) -> tuple[ToyHead, tuple[int, ...]]:
    """The registered loader: ``proj.weight`` and ``token_map``, for ``target`` only."""
    weight, token_map = files.tensors.get("proj.weight"), files.tensors.get("token_map")
    if weight is None or token_map is None:
        raise ModelLoadError(f"draft head '{files.name}': not a toy head (no proj.weight)")
    if weight.shape != (target.hidden_size, target.hidden_size):
        raise ModelLoadError(f"draft head '{files.name}': made for another hidden size")
    dtype = dtype or target.embedding_weight().dtype
    head = ToyHead(target.hidden_size, token_map, target.device, dtype)
    with torch.no_grad():
        head.proj.weight.copy_(weight)
    return head.eval().requires_grad_(False), (target.num_layers,)


@dataclass(frozen=True)
class ToyTrainer:
    """The registered trainer (``training.heads.HeadTrainer``)."""

    vocabulary_role: str = "training softmax"

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def new_head(self, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
                 seed: int) -> ToyHead:
        return ToyHead(target.hidden_size, vocab_ids, target.device).train()

    def trained_vocabulary(self, head: ToyHead, vocab_ids: torch.Tensor) -> torch.Tensor:
        return head.token_map.clone()

    def loss(self, head: ToyHead, target: FrozenTarget, features: torch.Tensor,
             ids: torch.Tensor, labels: torch.Tensor, lm_rows: torch.Tensor | None,
             to_subset: torch.Tensor, unroll: int) -> tuple[torch.Tensor, float]:
        """Cross-entropy of the token after the target's own, over ``lm_rows``."""
        assert lm_rows is not None
        logits = (head(features[:, :-1]) @ lm_rows.T).flatten(0, 1)  # [B * (T - 1), V']
        wanted = to_subset[labels[:, 1:]].reshape(-1)
        counted = wanted != IGNORE
        right = int((logits.argmax(-1) == wanted)[counted].sum())
        return (F.cross_entropy(logits, wanted, ignore_index=IGNORE),
                right / max(1, int(counted.sum())))

    def published_tensors(self, head: ToyHead, vocab_size: int) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu() for name, tensor in head.state_dict().items()}

    def config(self, head: ToyHead, layers: tuple[int, ...],
               target_name: str) -> dict[str, object]:
        return {"architectures": [ARCHITECTURE], "hidden_size": head.proj.in_features,
                "base_model_name_or_path": target_name}


TRAINER = ToyTrainer()

ENTRY = DrafterSpec(METHOD, "toy residual head (test)", f"{__name__}:build", needs="head",
                    weight_bytes=lambda target: 2 * target.hidden_size**2,
                    head=HeadSpec("toy residual", f"{__name__}:load", f"{__name__}:TRAINER",
                                  architectures=(ARCHITECTURE,)))
