"""Training Medusa heads: the ``HeadTrainer`` the "medusa" registry entry names.

The heads read the target's final state through its LM head cut to the training vocabulary
(saved as ``token_map``, vLLM's truncated vocabulary); their blocks start as the identity
(``training.heads``' module docstring), and ``losses.medusa_loss`` scores head i on the token
i + 1 past the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localspec.drafters.medusa_head import MedusaHeads
from localspec.training.heads import HeadShape
from localspec.training.losses import medusa_loss
from localspec.training.target import FrozenTarget


@dataclass(frozen=True)
class MedusaTrainer:
    """``HeadTrainer`` of Medusa heads."""

    vocabulary_role: str = "training softmax"

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """The final normed state."""
        return (num_layers,)

    def new_head(self, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
                 seed: int) -> MedusaHeads:
        """``shape.medusa_heads`` identity heads over the target's LM head rows of
        ``vocab_ids`` (nothing random: ``seed`` is not needed)."""
        heads = MedusaHeads(target.hidden_size, target.vocab_size, shape.medusa_heads,
                            shape.medusa_layers, own_lm_heads=False,
                            truncated_vocab=len(vocab_ids), device=target.device)
        heads.token_map.copy_(vocab_ids)
        return heads.train()

    def trained_vocabulary(self, head: MedusaHeads, vocab_ids: torch.Tensor) -> torch.Tensor:
        """A loaded head's ``token_map``, else ``vocab_ids``."""
        return vocab_ids if head.token_map is None else head.token_map.clone()

    def loss(self, head: MedusaHeads, target: FrozenTarget, features: torch.Tensor,
             ids: torch.Tensor, labels: torch.Tensor, lm_rows: torch.Tensor | None,
             to_subset: torch.Tensor, unroll: int) -> tuple[torch.Tensor, float]:
        """``losses.medusa_loss`` of the batch (``unroll`` is EAGLE's)."""
        if lm_rows is None:
            raise ValueError("Medusa heads are trained through the target's LM head rows")
        return medusa_loss(head, features, labels, lm_rows, to_subset)

    def published_tensors(self, head: MedusaHeads, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state under vLLM's names (ours already)."""
        return {name: tensor.detach().cpu() for name, tensor in head.state_dict().items()}

    def config(self, head: MedusaHeads, layers: tuple[int, ...],
               target_name: str) -> dict[str, object]:
        """config.json as the published Medusa heads spell it."""
        config: dict[str, object] = {
            "architectures": ["MedusaModel"], "medusa_num_heads": head.num_heads,
            "medusa_num_layers": len(head.blocks[0].layers), "hidden_size": head.hidden_size,
            "vocab_size": head.vocab_size, "base_model_name_or_path": target_name}
        if head.token_map is not None:
            config["truncated_vocab_size"] = len(head.token_map)
        return config


MEDUSA = MedusaTrainer()
