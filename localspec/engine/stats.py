"""Generation statistics, folded from the engine's step events (no tensors, no timing of its own
beyond the wall clock the caller hands in). Steps, drafts and acceptances are also kept per
drafter (``StepEvent.drafter``): an ``auto`` set's members each have their own."""

from __future__ import annotations

from dataclasses import dataclass, field

from localspec.engine.engine import StepEvent


@dataclass
class GenerationStats:
    """Counts and times over one or more generations."""

    new_tokens: int = 0
    target_forward_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose cache a request kept (``reuse_prefix``)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # drafter's name -> [steps it drafted, tokens drafted, tokens accepted]
    per_drafter: dict[str, list[int]] = field(default_factory=dict)

    def add(self, event: StepEvent) -> None:
        if not event.drafted and not event.tokens:
            return  # a cancellation marker, no forward pass
        self.new_tokens += len(event.tokens)
        self.cached_tokens += event.cached
        self.target_forward_passes += 1
        self.drafted += len(event.drafted)
        self.accepted += event.accepted
        self.draft_time += event.draft_time
        self.verify_time += event.verify_time
        if event.drafter is not None:
            counts = self.per_drafter.setdefault(event.drafter, [0, 0, 0])
            for j, n in enumerate((1, len(event.drafted), event.accepted)):
                counts[j] += n
        for i in range(len(event.drafted)):
            if i == len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < event.accepted)

    def merge(self, other: GenerationStats) -> GenerationStats:
        """Add another run's counts and times into this one; return self."""
        for name in ("new_tokens", "target_forward_passes", "drafted", "accepted",
                     "draft_time", "verify_time", "wall_time", "cached_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        for name, counts in other.per_drafter.items():
            mine = self.per_drafter.setdefault(name, [0, 0, 0])
            for j, n in enumerate(counts):
                mine[j] += n
        return self

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    def drafters(self) -> dict[str, dict[str, float | int]]:
        """Per drafter: the steps it drafted, its drafted and accepted tokens, its acceptance."""
        return {name: {"steps": steps, "drafted": drafted, "accepted": accepted,
                       "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0}
                for name, (steps, drafted, accepted) in self.per_drafter.items()}

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens_per_second": round(self.tokens_per_second, 3),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 3),
            "target_forward_passes": self.target_forward_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "new_tokens": self.new_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "draft_time_s": round(self.draft_time, 3),
            "verify_time_s": round(self.verify_time, 3),
            "wall_time_s": round(self.wall_time, 3),
            "accepted_per_position": list(self.accepted_per_position),
            "drafters": self.drafters(),
        }
