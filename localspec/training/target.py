"""The frozen target as training sees it: its embedding table, its LM head rows and final
norm as float tensors, and a fingerprint that says which target (and which weights) computed a
set of features.

The target is served through a ``ModelRunner`` whichever forward sits under it (Hugging Face
in any dtype or device, or the int8 CPU forward), so that the features a head trains on
are exactly those it drafts from when the same preset serves it: a head for the ``w8a8`` CPU
preset learns the int8 target's hidden states. Nothing here computes gradients for the target;
its tensors are read, never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from localspec.config import ModelSpec
from localspec.models.packed_store import NUMERICS as PACKED_NUMERICS
from localspec.runtime.runner import ModelRunner

FEATURES_FORMAT = 1  # bump when what a feature file holds changes: old caches are not reused


@dataclass(frozen=True)
class FrozenTarget:
    """Read-only views of the target a head is trained for."""

    runner: ModelRunner

    @property
    def device(self) -> torch.device:
        return torch.device(self.runner.device)

    @property
    def hidden_size(self) -> int:
        return self.runner.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> float32 embeddings [..., hidden] on the target's device."""
        table = self.runner.embedding_weight().detach()  # no gradient into the target
        return F.embedding(ids.to(table.device), table).float().to(self.device)

    def lm_head_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head's rows for token ids ``rows`` [n]: float32 [n, hidden] (an int8 or
        Q6_K head dequantized), what the served target multiplies its final hidden state by."""
        decoder = self.runner.decoder
        if decoder is None:
            weight = self.runner.model.get_output_embeddings().weight.detach()
            return weight[rows.to(weight.device)].float().to(self.device)
        return decoder.head.rows(rows.cpu()).to(self.device)

    def final_norm(self) -> torch.Tensor | None:
        """The final RMS norm's weight [hidden] (float32), None when the model has none."""
        if self.runner.decoder is not None:
            return self.runner.decoder.norm.float().to(self.device)
        norm = getattr(self.runner.model.base_model, "norm", None)
        weight = getattr(norm, "weight", None)
        return None if weight is None else weight.detach().float().to(self.device)


def fingerprint(spec: ModelSpec, folder: Path, device: str, logits_fp32: bool) -> dict[str, object]:
    """What decides a target's features: the model as named and served (dtype,
    quantization and the numbers its packed weights hold, device kind, float32 logits) and its files
    (name, size, modification time), so that weights changed in place are not mistaken for
    the old ones."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                   for p in Path(folder).iterdir() if p.is_file())
    return {"format": FEATURES_FORMAT, "model": spec.model, "dtype": spec.dtype,
            "quantization": spec.quantization, "packed_format": PACKED_NUMERICS,
            "device": torch.device(device).type,
            "logits_fp32": logits_fp32, "files": [list(f) for f in files]}
