"""Several sequences through the native decoder stack in one call (``forward_batch``): every
row's logits, keys, values and features are bit for bit those of its sequence fed alone,
whatever else is in the batch (chains of different lengths and starts, a tree)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_helpers import kernel_lib
from test_tree import PARENTS, native_model, native_runner, tokens

from localspec.runtime.runner import Feed, ModelRunner, forward_batch


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return kernel_lib(tmp_path_factory)


def sibling_runners(count: int, lib: ctypes.CDLL) -> list[ModelRunner]:
    """``count`` runners over one decoder (shared weights), each with its own cache."""
    first = native_runner(native_model(seed=11), lib)
    return [first, *(ModelRunner(first.model, decoder=first.decoder) for _ in range(count - 1))]


def test_batched_rows_are_the_bits_of_each_sequence_alone(lib: ctypes.CDLL) -> None:
    """Three sequences (prompts of 5, 17 and 33 tokens; feeds of 1 token, a chain of 4 and a
    tree) in one call give each the logits, cache and features it gets alone; a second batched
    step (now from other lengths) too."""
    batched, alone = sibling_runners(3, lib), sibling_runners(3, lib)
    for runners in (batched, alone):
        runners[2].record_features((0, 1, 2))
    prompts = [tokens(5, 1), tokens(17, 2), tokens(33, 3)]
    for runners in (batched, alone):
        for runner, prompt in zip(runners, prompts, strict=True):
            runner.forward(prompt)
    steps = [
        [Feed(batched[0], tokens(1, 4)), Feed(batched[1], tokens(4, 5)),
         Feed(batched[2], tokens(len(PARENTS), 6), parents=PARENTS)],
        [Feed(batched[0], tokens(3, 7)), Feed(batched[1], tokens(1, 8), logits_to_keep=1),
         Feed(batched[2], tokens(2, 9))],
    ]
    for step in steps:
        got = forward_batch(step)
        assert batched[0].batches_with(batched[1])
        for feed, logits, runner in zip(step, got, alone, strict=True):
            want = runner.forward(feed.token_ids, feed.logits_to_keep, feed.parents)
            assert torch.equal(logits, want)
            assert feed.runner.length == runner.length
            end = runner.length
            for name in ("keys", "values"):
                assert torch.equal(getattr(feed.runner.kv_cache, name)[:, :, :end],
                                   getattr(runner.kv_cache, name)[:, :, :end])
        if step is steps[0]:  # the tree's off-chain path kept, in both
            batched[2].keep_path([0, 4, 5])
            alone[2].keep_path([0, 4, 5])
    assert torch.equal(batched[2].features(0, batched[2].length),
                       alone[2].features(0, alone[2].length))
    # the negative control: the same tokens after another prompt give other logits
    assert not torch.equal(alone[0].forward([1]), alone[1].forward([1]))


def test_runners_of_other_decoders_run_one_after_another(lib: ctypes.CDLL) -> None:
    """Runners of two models do not batch (``batches_with``), yet ``forward_batch`` gives each
    its own forward's logits; a runner fed twice in one batch is refused."""
    a = native_runner(native_model(seed=12), lib)
    b = native_runner(native_model(seed=13), lib)
    assert not a.batches_with(b)
    ref_a, ref_b = native_runner(native_model(seed=12), lib), native_runner(native_model(seed=13),
                                                                            lib)
    got = forward_batch([Feed(a, tokens(3, 1)), Feed(b, tokens(2, 2))])
    assert torch.equal(got[0], ref_a.forward(tokens(3, 1)))
    assert torch.equal(got[1], ref_b.forward(tokens(2, 2)))
    with pytest.raises(ValueError, match="each runner once"):
        forward_batch([Feed(a, [1]), Feed(a, [2])])
