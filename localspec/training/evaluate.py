"""How well a trained head drafts: mean accepted length on held-out prompts, through the engine
the app runs.

The saved folder is loaded the way a preset loads it (``[speculative_config] method`` and
``model = <folder>``, through ``Pipeline`` and the drafters' loaders), so a head that measures
here loads in a preset. Generation is greedy with a fixed draft length ``k`` and no confidence
cut-off, so the number measures the head alone: tokens per target pass (1.0 is plain decoding,
k + 1 the most), the share of drafts accepted and the acceptance at each draft position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from localspec.config import Preset, SpeculativeConfig
from localspec.engine.stats import GenerationStats
from localspec.models.cache import Progress, no_progress
from localspec.models.loading import LoadedModel
from localspec.pipeline import Pipeline


@dataclass(frozen=True)
class Acceptance:
    prompts: int
    k: int
    new_tokens: int
    target_passes: int
    mean_accepted_length: float  # tokens per target pass
    acceptance_rate: float  # accepted drafts / drafts
    per_position: tuple[float, ...]  # acceptance at draft position 1, 2, ...
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return {"prompts": self.prompts, "k": self.k, "new_tokens": self.new_tokens,
                "target_passes": self.target_passes,
                "mean_accepted_length": round(self.mean_accepted_length, 3),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "per_position": [round(a, 3) for a in self.per_position],
                "seconds": round(self.seconds, 2)}


def head_preset(preset: Preset, method: str, folder: Path, k: int) -> Preset:
    """``preset`` drafting with the head in ``folder``: fixed k, no confidence cut-off."""
    speculative = SpeculativeConfig(method=method, model=str(folder), num_speculative_tokens=k)
    settings = preset.localspec.model_copy(update={"draft_confidence_threshold": 0.0,
                                                   "adaptive_k": False})
    return preset.model_copy(update={"speculative_config": speculative, "localspec": settings})


def measure_acceptance(preset: Preset, target: LoadedModel, method: str, folder: Path,
                       prompts: list[list[int]], max_new_tokens: int, k: int,
                       progress: Progress = no_progress) -> Acceptance:
    """Greedy generations of ``max_new_tokens`` from each prompt with the saved head."""
    pipe = Pipeline(head_preset(preset, method, folder, k), target, None)
    engine = pipe.engine(method)
    stats = GenerationStats()
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        progress("measuring acceptance", i / len(prompts))
        request = pipe.request(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                               num_speculative_tokens=k, adaptive=False)
        stats = stats.merge(pipe.run(request, engine=engine).stats)
    progress("measuring acceptance", 1.0)
    per_position = tuple(a / d for a, d in zip(stats.accepted_per_position,
                                               stats.drafted_per_position, strict=True) if d)
    return Acceptance(len(prompts), k, stats.new_tokens, stats.target_forward_passes,
                      stats.mean_accepted_length, stats.acceptance_rate, per_position,
                      time.perf_counter() - began)
