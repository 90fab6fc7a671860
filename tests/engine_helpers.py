"""What the engine test modules share: their prompts, sampling settings and request builder,
and plain greedy decoding, the reference that greedy speculation must reproduce token for
token. The drafters they run come from conftest (``draft_drafter``, ``make_drafter``)."""

from __future__ import annotations

import torch
from conftest import collect, decode
from transformers import PreTrainedModel

from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PROMPTS = {
    "random-a": [5, 17, 33, 2, 80, 41, 9],
    "random-b": [60, 3, 91, 44, 12, 12, 70, 8, 25, 38, 77],
    # repeats itself, so prompt lookup has something to copy from the start
    "repetitive": [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11],
}
MAX_NEW = 40
GREEDY = SamplingParams()
HOT = SamplingParams(temperature=1.0)


def request(prompt: list[int], k: int = 3, adaptive: bool = False, max_new_tokens: int = MAX_NEW,
            sampling: SamplingParams = GREEDY, **kwargs: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                             sampling=sampling, num_speculative_tokens=k, adaptive=adaptive,
                             **kwargs)


def plain_tokens(target_model: PreTrainedModel, prompt: list[int], eos: set[int] | None = None,
                 max_new_tokens: int = MAX_NEW) -> list[int]:
    engine = SpeculativeEngine(ModelRunner(target_model), (), decode, eos or set())
    return collect(engine, request(prompt, max_new_tokens=max_new_tokens))[0]


class Gate(Drafter):
    """Proposes the answer's own next tokens (``reference``: plain greedy output after the
    prompt) in blocks of ``block`` generated tokens, and nothing in the blocks between: put
    first in a set of drafters, it leaves the next one skipped for several steps at a time,
    then asked."""

    traits = DrafterTraits("gate")

    def __init__(self, reference: list[int], prompt_length: int, block: int = 6) -> None:
        self.reference, self.prompt_length, self.block = reference, prompt_length, block

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless: the context says where the answer is."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        done = len(context) - self.prompt_length
        if (done // self.block) % 2:
            return Proposal([])
        return Proposal(self.reference[done : done + k])
