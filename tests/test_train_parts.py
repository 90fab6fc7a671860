"""Training a draft head, its parts on their own: the corpus reader's bounds (in total, and a
folder that cannot be listed), ``.jsonl`` requests and sources interleaved, the answer cache
past a line cut short, the batched training-time-test forward equal to the drafter's forward,
the default head sizes within the 40 MB budget for the bundled 1.5B, the default corpus and
vocabulary, and gradients that reach the head alone from a seeded start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from head_models import llama_target
from transformers import Qwen2Config

from localspec.drafters.eagle_head import EagleHead, HeadCache
from localspec.drafters.medusa import MedusaHeads
from localspec.errors import InputFileError
from localspec.runtime.runner import ModelRunner
from localspec.training.answers import AnswerCache
from localspec.training.corpus import default_documents, user_documents
from localspec.training.heads import (
    HeadShape,
    feature_layers,
    head_bytes,
    head_trainer,
    new_head,
    vocabulary,
)
from localspec.training.losses import IGNORE, eagle_loss, eagle_unroll
from localspec.training.target import FrozenTarget


def test_answer_cache_skips_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "answers.jsonl"
    cache = AnswerCache(path)
    cache.put("first request", "first answer")
    cache.put("second request", "second answer")
    with path.open("a", encoding="utf-8") as f:
        f.write('{"prompt_sha256": "ab')  # a write killed half-way
    again = AnswerCache(path)
    assert len(again) == 2 and again.get("second request") == "second answer"
    assert again.get("third request") is None


def test_corpus_is_bounded_in_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file is bounded when it is read; a folder of many is bounded too, by the sizes of
    what it holds, before any is read."""
    import localspec.training.corpus as corpus_module

    monkeypatch.setattr(corpus_module, "MAX_CORPUS_BYTES", 100)
    for name in ("a.txt", "b.md"):
        (tmp_path / name).write_text("word " * 12, encoding="utf-8")
    with pytest.raises(InputFileError, match=f"--corpus {tmp_path}: its files hold 120 bytes, "
                                             "more than the 100 bytes"):
        user_documents([str(tmp_path)])


def test_corpus_folder_that_cannot_be_listed(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``--corpus /`` meets /proc/1/cwd: an error naming what could not be read."""

    def denied(*_args: object) -> None:
        raise PermissionError(13, "Permission denied", "/proc/1/cwd")

    monkeypatch.setattr(Path, "rglob", denied)
    with pytest.raises(InputFileError, match=f"--corpus {tmp_path}: cannot read /proc/1/cwd: "
                                             "Permission denied"):
        user_documents([str(tmp_path)])


def test_corpus_requests_file_and_interleaved_sources(tmp_path: Path) -> None:
    """A ``.jsonl`` file gives one request per line (the answer optional only when the target
    answers); several sources alternate, ``stdlib`` among them, so a budget takes from
    each."""
    requests = tmp_path / "chat.jsonl"
    requests.write_text('{"prompt": "Why is the sky blue?"}\n\n'
                        '{"prompt": "Hi", "answer": "Hello!"}\n', encoding="utf-8")
    with pytest.raises(InputFileError, match=r"chat.jsonl:1: a request without an \"answer\""):
        user_documents([str(requests)])
    docs = list(user_documents([str(requests)], answered=False))
    assert [(d.prompt, d.text) for d in docs] == [("Why is the sky blue?", ""), ("Hi", "Hello!")]
    mixed = list(user_documents([str(requests), "stdlib"], answered=False))
    stdlib = default_documents()
    assert mixed[:4] == [docs[0], next(stdlib), docs[1], next(stdlib)]
    for bad, why in (('["Hi"]', "expected"), ('{"prompt": ""}', "expected"),
                     ('{"prompt": "Hi", "answer": 3}', "expected"), ("{oops", "not JSON")):
        requests.write_text(f'{{"prompt": "ok"}}\n{bad}\n', encoding="utf-8")
        with pytest.raises(InputFileError, match=f"chat.jsonl, line 2: {why}"):
            user_documents([str(requests)], answered=False)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_unroll_equals_the_drafters_forward(method: str) -> None:
    """Step d at position t of the batched training forward is the head's output after
    feeding real features up to t - d and then drafting d steps on its own outputs, as
    ``EagleDrafter`` does with its KV cache (float64: equal to rounding)."""
    config = llama_target().config
    head = EagleHead(head_trainer(method).spec(config, HeadShape(attention_heads=4), 60),
                     dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in head.parameters():
            noise = 0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.copy_(noise + (1.0 if param.dim() == 1 else 0.0))
    width = 32 if method == "eagle" else 96
    features = torch.randn((2, 10, width), generator=generator, dtype=torch.float64)
    embeds = torch.randn((2, 10, 32), generator=generator, dtype=torch.float64)
    outputs = eagle_unroll(head, features, embeds, 3)
    for b in range(2):
        for d in range(4):
            for t in range(d, 10):
                cache = HeadCache(head.spec, torch.float64, "cpu")
                _, out = head(features[b, :t - d + 1], embeds[b, :t - d + 1], 0, cache, True)
                out = out[-1:]
                for j in range(1, d + 1):
                    _, out = head(out, embeds[b, t - d + j:t - d + j + 1], t - d + j, cache,
                                  False)
                torch.testing.assert_close(outputs[d][b, t], out[0], rtol=1e-9, atol=1e-9)


def test_default_head_sizes_fit_the_budget_for_the_bundled_model() -> None:
    """Qwen2.5-Coder-1.5B's shape (no weights): every default head <= 40 MB as saved."""
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768)
    sizes = {method: head_bytes(EagleHead(head_trainer(method).spec(config, HeadShape(), 4096),
                                          device="meta"), 151936)
             for method in ("eagle", "eagle3")}
    sizes["medusa"] = head_bytes(MedusaHeads(1536, 151936, HeadShape().medusa_heads,
                                             own_lm_heads=False, truncated_vocab=4096,
                                             device="meta"), 151936)
    assert all(size <= 40e6 for size in sizes.values()), sizes
    assert sizes["eagle3"] > 35e6  # the budget is used, not wasted


def test_default_corpus_and_vocabulary() -> None:
    """The standard library's functions as requests and fenced answers, in a fixed order;
    the vocabulary is the most frequent ids, ties by id."""
    documents = [d for _, d in zip(range(12), default_documents(), strict=False)]
    again = [d for _, d in zip(range(12), default_documents(), strict=False)]
    assert len(documents) == 12 and documents == again
    assert all(d.prompt.startswith("Write the Python ") and d.text.startswith("```python\n")
               for d in documents)
    ids, coverage = vocabulary([[5, 5, 5, 7, 7, 9], [1, 9]], vocab_size=12, size=3)
    assert ids.tolist() == [5, 7, 9] and coverage == pytest.approx(7 / 8)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_only_the_head_learns_and_its_start_is_seeded(method: str) -> None:
    """Gradients reach the head's parameters and none of the target's (embedding table and
    LM head rows included); the head's first weights depend on its seed alone."""
    model = llama_target()
    runner = ModelRunner(model)
    target = FrozenTarget(runner)
    vocab_ids = torch.arange(0, 97, 2)
    heads = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        heads.append(new_head(method, target, HeadShape(), vocab_ids, seed=5))
    assert all(torch.equal(a, b) for a, b in zip(heads[0].state_dict().values(),
                                                 heads[1].state_dict().values(), strict=True))
    ids = torch.randint(97, (24,), generator=torch.Generator().manual_seed(0))
    runner.record_features(feature_layers(method, runner.num_layers))
    labels = runner.forward(ids.tolist()).argmax(-1)
    features = runner.features(0, 24).clone()  # out of inference mode, as read from disk
    to_subset = torch.full((97,), IGNORE)
    to_subset[vocab_ids] = torch.arange(len(vocab_ids))
    lm_rows = target.lm_head_rows(vocab_ids) if method == "eagle" else None
    loss, _ = eagle_loss(heads[0], features[None], ids[None], labels[None],
                         target.embed(ids[None]), lm_rows, to_subset, unroll=2)
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in heads[0].parameters())
