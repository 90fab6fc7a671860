"""The fastest any drafting policy could answer, given what each drafter would have guessed.

Why: a speed goal for speculation is only worth chasing if this machine and these drafters can
reach it. For one greedy answer ``A`` (the target's own tokens), a drafter's *run* at answer
position i is how many of ``A[i:]`` it would have guessed in a row from the true prefix (a
chain drafter that guesses right stays on the true prefix, so one teacher-forced pass gives
every run). An oracle that knows every run drafts, at each step, exactly the tokens that will
be kept (or nothing), from the drafter whose choice leads to the least total time; dynamic
programming over the answer's positions finds that time.

Costs are what the caller measured on this machine: a target pass over n rows
(``verify[n - 1]``), each drafter's cost per drafted token, a fixed cost per pass. Everything
left out favours the oracle (a drafter's catch-up after resting, wasted drafts, thresholds),
so the result bounds from above what chain drafting with these drafters can give: no policy
(adaptive k, drafter choice) can beat it.

The oracle's edge is foresight: it knows where the draft's runs start. A policy sees the draft's
confidence in each guess, not the verdict. ``blind_time`` prices that: the draft's guess at
position i is kept with a chance known in advance (its calibrated confidence there, given to
the policy before drafting, which no policy has), independently of the others (on the chat
answers measured here a guess is kept as often after a kept guess as after a miss, at each
confidence), and lookup stays an oracle. The least *expected* time under that model is what a
policy that reads the draft's confidence could reach, at best.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterRuns:
    """One drafter's runs over an answer and its measured cost per drafted token (seconds)."""

    name: str
    runs: list[int]  # runs[i]: answer tokens from position i it would have guessed in a row
    cost_per_token: float


@dataclass(frozen=True)
class Ceiling:
    """The oracle's decoding time, its passes and the drafter it used on each."""

    seconds: float
    steps: list[tuple[str | None, int]]  # (drafter or None for a plain step, tokens drafted)

    @property
    def passes(self) -> int:
        return len(self.steps)


def oracle_time(length: int, verify: list[float], drafters: list[DrafterRuns],
                per_pass: float = 0.0) -> Ceiling:
    """The least time to decode ``length`` answer tokens: each pass either decodes one token
    plainly (``verify[0]``) or verifies l <= len(verify) - 1 tokens a drafter would have guessed
    in a row there, at l times its cost per token plus ``verify[l]``, keeping l + 1 tokens
    (the target's own next token comes with every pass)."""
    if not verify:
        raise ValueError("verify needs the cost of a one-row pass at least")
    for d in drafters:
        if len(d.runs) != length:
            raise ValueError(f"{d.name}: {len(d.runs)} runs for an answer of {length} tokens")
    k_max = len(verify) - 1
    best = [0.0] * (length + 1)  # best[i]: least time from position i to the end
    choice: list[tuple[str | None, int]] = [(None, 0)] * length
    for i in range(length - 1, -1, -1):
        best[i] = verify[0] + per_pass + best[i + 1]  # a plain step, unless a draft beats it
        for d in drafters:
            for n in range(1, min(d.runs[i], k_max) + 1):
                t = n * d.cost_per_token + verify[n] + per_pass + best[min(i + n + 1, length)]
                if t < best[i]:
                    best[i], choice[i] = t, (d.name, n)
    steps, i = [], 0
    while i < length:
        steps.append(choice[i])
        i += choice[i][1] + 1
    return Ceiling(best[0], steps)


def blind_time(verify: list[float], chances: list[float], cost_per_token: float,
               per_pass: float = 0.0, lookup: DrafterRuns | None = None) -> float:
    """The least expected time to decode ``len(chances)`` answer tokens when each pass is a
    plain step, an oracle's lookup draft (``lookup``'s runs, as ``oracle_time``), or k draft
    tokens, each kept with ``chances[i]`` at answer position i, independently, and the pass
    keeping the longest kept prefix plus the target's token; k is chosen knowing every chance
    but no verdict."""
    if not verify:
        raise ValueError("verify needs the cost of a one-row pass at least")
    length, k_max = len(chances), len(verify) - 1
    if lookup is not None and len(lookup.runs) != length:
        raise ValueError(f"{lookup.name}: {len(lookup.runs)} runs for {length} chances")
    best = [0.0] * (length + 1)
    for i in range(length - 1, -1, -1):
        after = [best[min(j, length)] for j in range(i + 1, i + k_max + 2)]
        best[i] = verify[0] + per_pass + after[0]
        for n in range(1, min(lookup.runs[i] if lookup else 0, k_max) + 1):
            best[i] = min(best[i], n * lookup.cost_per_token + verify[n] + per_pass + after[n])
        survive, expected = 1.0, 0.0  # P(the first m drafts kept), E[time after the pass]
        for k in range(1, k_max + 1):
            chance = chances[i + k - 1] if i + k - 1 < length else 0.0
            expected += survive * (1.0 - chance) * after[k - 1]
            survive *= chance
            cost = k * cost_per_token + verify[k] + per_pass + expected + survive * after[k]
            best[i] = min(best[i], cost)
    return best[0]


def runs_from_agreement(agree: list[bool]) -> list[int]:
    """``agree[i]``: the drafter's guess at position i, from the true prefix, is the answer's
    token. The run at i counts the agreements from i up to the first miss."""
    runs = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return runs[:-1]
