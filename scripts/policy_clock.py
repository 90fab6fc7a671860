"""Drafting policies compared on a virtual clock: the same run every time, whatever the VM does.

The engine and the draft model time themselves with ``time.perf_counter``; here that clock
advances only when a runner's forward is called, by a fixed cost model (a target pass over n
rows, a prefill, a draft forward), so adaptive k and the drafter choice see the same costs on
every run and a policy's tokens per second is a pure function of its decisions. A policy
variant patches one of the engine's constants (``--variants``: ``margin0`` sets
``adaptive.DRAFT_MARGIN`` to 0, ``probe2`` the first probe interval to 2, ``noski`` stops
pricing a drafter's catch-up in ``DrafterChoice``, ``tau0.8`` sets each model-based drafter's
``confidence_threshold`` to 0.8, ``pw4`` weighs a drafter's kept share over earlier requests as 4
steps of this answer's (``choice.LEARNT_PRIOR_WEIGHT``), ``nolearnt`` leaves that prior out,
``rent3`` and ``allow6`` set ``choice.CATCH_UP_RENT`` and ``CATCH_UP_ALLOWANCE`` (``rent1+allow0``:
the whole lost step as rent, no allowance), ``long12`` sets ``ngram.LONG_MATCH`` (``long0``: no
second grade of lookup's evidence), ``copy0.9`` and ``copyw4`` the prior of that grade's
estimator (``choice.LONG_COPY_PRIOR``, ``LONG_COPY_WEIGHT``), ``sufmin4`` the shortest match the
suffix drafter drafts from (``suffix.MIN_MATCH``); joined with ``+``).

Without ``--noise`` the clock has none, and noise is what ``DRAFT_MARGIN`` and the stall guards
exist for; ``--noise SIGMA`` multiplies the cost of each step's forward (not a prefill's) by a
seeded log-normal factor of mean 1, the same draws for every variant (seeded per prompt, so a
variant that changes one answer's forwards leaves the draws of the others alone), so the policy
decides on noisy measurements while its expected costs stay those of the model. A variant that
gains here still needs a ``bench`` run to confirm it on the machine.

    python3 scripts/policy_clock.py --variants base,margin0 --methods auto
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import types
from collections.abc import Callable
from functools import partialmethod
from pathlib import Path
from typing import Any

import localspec.drafters.base as drafter_base
import localspec.engine.adaptive as adaptive
import localspec.engine.choice as choice
import localspec.engine.engine as engine
from localspec.drafters import ngram, suffix
from localspec.drafters.base import Calibration
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.runner import ModelRunner
from localspec.training.prompts import encode_prompts, load_prompts

# ms: a target pass of one row, each of rows 2-5, each past 5, the engine's own time a pass, a
# draft token, each further row of a draft feed, a target prefill row (this EPYC VM,
# docs/research-log.md)
COSTS = {"t1": 30.0, "row": 3.5, "row_wide": 5.5, "pass": 1.0, "draft": 10.4,
         "draft_row": 1.9, "prefill_row": 6.3}
HELDOUT = Path(__file__).resolve().parent.parent / "localspec" / "data" / "heldout"


class VirtualClock:
    """``perf_counter`` for the engine, its policy and the drafters, moved by each forward's
    cost."""

    def __init__(self, costs: dict[str, float], target: ModelRunner, k_max: int,
                 noise: float = 0.0, seed: int = 0) -> None:
        self.now, self.costs, self.target, self.k_max = 0.0, costs, target, k_max
        self.noise, self.random = noise, random.Random(seed)

    def perf_counter(self) -> float:
        return self.now

    def cost(self, target: bool, rows: int) -> float:
        """Seconds of a forward over ``rows`` tokens (a target feed wider than a verify pass
        is a prefill)."""
        c = self.costs
        if not target:
            return (c["draft"] + c["draft_row"] * (rows - 1)) / 1e3
        if rows > self.k_max + 1:
            return c["prefill_row"] * rows / 1e3
        return (c["t1"] + c["pass"] + c["row"] * min(rows - 1, 4)
                + c["row_wide"] * max(0, rows - 5)) / 1e3

    def factor(self, rows: int) -> float:
        """A seeded log-normal factor of mean 1 on a step's forward (the VM's drift, as the
        engine would measure it); 1 for a prefill or catch-up, whose one draw would swing a
        whole answer's time."""
        if not self.noise or rows > self.k_max + 1:
            return 1.0
        return self.random.lognormvariate(-self.noise * self.noise / 2, self.noise)

    def install(self) -> Callable[[], None]:
        """Time the engine by this clock; returns what undoes it."""
        forward = ModelRunner.forward
        clock = self

        def timed(runner: ModelRunner, token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
            clock.now += clock.cost(runner is clock.target, len(token_ids)) * clock.factor(
                len(token_ids))
            return forward(runner, token_ids, *args, **kwargs)

        fake = types.SimpleNamespace(perf_counter=self.perf_counter)
        timed_modules = (engine, choice, drafter_base)  # the step, the drafting, a catch-up
        saved = [module.time for module in timed_modules]
        ModelRunner.forward = timed
        for module in timed_modules:
            module.time = fake

        def undo() -> None:
            ModelRunner.forward = forward
            for module, kept in zip(timed_modules, saved, strict=True):
                module.time = kept

        return undo


def _order_free(self: choice.DrafterChoice, order: Callable[..., Any], sure: list[bool],
                catch_up: list[float] | None = None, load: Any = adaptive.ALONE
                ) -> list[choice.Attempt]:
    """``DrafterChoice.order`` as if every catch-up were free."""
    return order(self, sure, None, load)


def apply(variant: str, defaults: dict[str, Any]) -> float | None:
    """Set the engine's constants to ``variant`` (from ``defaults``); return the drafters'
    confidence threshold it asks for (None: the preset's)."""
    threshold = None
    adaptive.DRAFT_MARGIN = defaults["margin"]
    adaptive.FIRST_PROBE_INTERVAL = defaults["probe"]
    choice.DrafterChoice.order = defaults["order"]
    choice.LEARNT_PRIOR_WEIGHT = defaults["weight"]
    choice.CATCH_UP_RENT = defaults["rent"]
    choice.CATCH_UP_ALLOWANCE = defaults["allowance"]
    Calibration.kept_share = defaults["share"]
    ngram.LONG_MATCH = defaults["long"]
    suffix.MIN_MATCH = defaults["sufmin"]
    choice.LONG_COPY_PRIOR, choice.LONG_COPY_WEIGHT = defaults["copy"], defaults["copyw"]
    for part in variant.split("+"):
        if part.startswith("margin"):
            adaptive.DRAFT_MARGIN = float(part.removeprefix("margin"))
        elif part.startswith("probe"):
            adaptive.FIRST_PROBE_INTERVAL = int(part.removeprefix("probe"))
        elif part == "noski":
            choice.DrafterChoice.order = partialmethod(_order_free, defaults["order"])
        elif part.startswith("pw"):
            choice.LEARNT_PRIOR_WEIGHT = float(part.removeprefix("pw"))
        elif part.startswith("allow"):
            choice.CATCH_UP_ALLOWANCE = float(part.removeprefix("allow"))
        elif part.startswith("rent"):
            choice.CATCH_UP_RENT = float(part.removeprefix("rent"))
        elif part == "nolearnt":
            Calibration.kept_share = lambda self: None
        elif part.startswith("long"):
            ngram.LONG_MATCH = int(part.removeprefix("long")) or 1 << 30
        elif part.startswith("copyw"):
            choice.LONG_COPY_WEIGHT = float(part.removeprefix("copyw"))
        elif part.startswith("copy"):
            choice.LONG_COPY_PRIOR = float(part.removeprefix("copy"))
        elif part.startswith("sufmin"):
            suffix.MIN_MATCH = int(part.removeprefix("sufmin"))
        elif part.startswith("tau"):
            threshold = float(part.removeprefix("tau"))
        elif part != "base":
            raise SystemExit(f"unknown variant part {part!r}")
    return threshold


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-auto")
    parser.add_argument("--variants", default="base")
    parser.add_argument("--methods", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--costs", default="{}", help="JSON overriding COSTS' entries (ms)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="sigma of a log-normal factor on each forward's cost (plain "
                             "decoding is timed without it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pipe = Pipeline.load(load_preset(args.preset))
    k_max = pipe.preset.speculative_config.num_speculative_tokens
    clock = VirtualClock({**COSTS, **json.loads(args.costs)}, pipe.target_runner(), k_max,
                         seed=args.seed)
    sets = {"bench": load_prompts(None)}
    for name in ("chat", "code"):
        lines = (HELDOUT / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        sets[f"held-out {name}"] = [json.loads(line) for line in lines if line.strip()]
    encoded = {name: encode_prompts(pipe, rows, args.tokens) for name, rows in sets.items()}
    defaults = {"margin": adaptive.DRAFT_MARGIN, "probe": adaptive.FIRST_PROBE_INTERVAL,
                "order": choice.DrafterChoice.order,
                "weight": choice.LEARNT_PRIOR_WEIGHT, "rent": choice.CATCH_UP_RENT,
                "allowance": choice.CATCH_UP_ALLOWANCE, "share": Calibration.kept_share,
                "long": ngram.LONG_MATCH, "sufmin": suffix.MIN_MATCH,
                "copy": choice.LONG_COPY_PRIOR, "copyw": choice.LONG_COPY_WEIGHT}
    undo = clock.install()

    def clocked(ids: list[int], method: str) -> float:
        start = clock.now
        pipe.run(pipe.request(ids, max_new_tokens=args.tokens, temperature=0.0), method)
        return clock.now - start

    try:
        plain = {name: [clocked(ids, "none") for ids in prompts]
                 for name, prompts in encoded.items()}
        clock.noise = args.noise
        for variant in args.variants.split(","):
            threshold = apply(variant, defaults)
            for method in args.methods.split(","):
                # fresh drafters: calibration and prices learnt by an earlier run stay out
                pipe._engines.clear()
                for member in pipe.engine(method).drafters:
                    if threshold is not None and member.confidence_threshold > 0:
                        member.confidence_threshold = threshold
                line, every = f"{variant:22s} {method:11s}", []
                for name, prompts in encoded.items():
                    speedups = []
                    for index, (ids, base) in enumerate(zip(prompts, plain[name], strict=True)):
                        # draws of their own per prompt: a variant that changes one answer's
                        # forwards must not shift the draws of every answer after it
                        clock.random.seed(f"{args.seed}/{name}/{index}")
                        speedups.append(base / clocked(ids, method))
                    every += speedups
                    line += f" | {name} mean {statistics.mean(speedups):.3f}"
                    if name == "bench":
                        line += " (" + " ".join(f"{s:.2f}" for s in speedups) + ")"
                print(f"{line} | all mean {statistics.mean(every):.3f}", flush=True)
    finally:
        apply("base", defaults)
        undo()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
