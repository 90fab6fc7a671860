"""The suffix drafter's history of earlier answers, from where the app keeps them: read from a real
conversations database when a preset loads (complete answers of live conversations, newest
first up to the cap), learnt as saved answers finish (the API with a store), kept across a
preset switch on the same target, and off by a preset key or a flag. Also its registry entry's
export to vLLM and ``bench``'s histories (a file, a session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from api_helpers import serving
from conftest import run_cli
from openai import OpenAI

from localspec.chats.store import ChatStore, Message
from localspec.cli.bench_history import history_texts
from localspec.cli.export import export_vllm
from localspec.cli.main import build_parser
from localspec.config import parse_preset
from localspec.drafters.suffix import SuffixDrafter
from localspec.drafters.suffix_index import LEAD_TOKENS
from localspec.errors import ConfigError
from localspec.host import ModelHost
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.ui.launch import parse_args

ANSWERS = ["def add(a, b):\n    return a + b\n", "print('hello world')\n"]


def fill(store: ChatStore) -> None:
    """Two complete answers in live conversations, and three that must not be read: one cut
    short, one empty, one in a deleted conversation."""
    store.create([Message("user", "add?"), Message("assistant", ANSWERS[0])])
    store.create([Message("user", "hello?"), Message("assistant", ANSWERS[1]),
                  Message("user", "again?"), Message("assistant", "cut sho", complete=False)])
    store.create([Message("user", "nothing?"), Message("assistant", "")])
    gone, _ = store.create([Message("user", "secret?"), Message("assistant", "deleted words")])
    store.delete(gone)


def test_the_store_gives_complete_live_answers_oldest_first(tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        fill(store)
        assert store.answer_texts(10_000) == ANSWERS
        assert store.answer_texts(len(ANSWERS[1])) == ANSWERS[1:]  # the newest that fit
        assert store.answer_texts(0) == []


def test_a_preset_load_reads_the_saved_answers(tmp_path: Path, presets: dict[str, str]) -> None:
    """The host hands the new pipeline the store's answers in the target's tokens (in the
    background); a saved answer that finishes is learnt too; a switch to a preset on the same
    target keeps them; a host without a store reads and learns nothing."""
    with ChatStore(tmp_path / "chats.db") as store:
        fill(store)
        host = ModelHost(warm_up=False, audit=False, history=store)
        assert host.load(presets["ngram"]), host.status().error
        assert host.wait_history(30)  # read in the background
        pipe = host.pipeline
        assert (pipe.history.answers, pipe.answer_history()) == (2, pipe.history)
        ids = pipe.tokenizer(ANSWERS[0], add_special_tokens=False)["input_ids"]
        assert pipe.history.tokens == sum(
            len(pipe.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in ANSWERS)
        drafter = pipe.engine("suffix").drafters[0]
        assert isinstance(drafter, SuffixDrafter) and drafter.history is pipe.history
        assert drafter.propose(ids[:6], 4, *greedy()).tokens == ids[6:10]  # from the history
        host.remember_answer(pipe, [5, 6, 7], [1, 2])
        assert pipe.history.answers == 3
        assert host.load(presets["draft"]) and host.wait_history(30)  # same target: kept,
        assert host.pipeline.history is pipe.history and pipe.history.answers == 3  # not re-read
        none = ModelHost(warm_up=False, audit=False)
        assert none.load(presets["ngram"]), none.status().error
        none.remember_answer(none.pipeline, [5, 6, 7], [1, 2])
        assert none.pipeline.history.answers == 0


def greedy() -> tuple:
    import torch

    from localspec.sampling import SamplingParams
    return SamplingParams(), torch.Generator()


def test_history_drafts_off(tmp_path: Path, presets: dict[str, str]) -> None:
    """``[localspec] history_drafts = false``: no history handed to the drafter, none read or
    learnt; the app's and serve's flags turn it off too (default on)."""
    text = Path(presets["ngram"]).read_text(encoding="utf-8")
    off = tmp_path / "off.toml"
    off.write_text(text.replace("[localspec]\n", "[localspec]\nhistory_drafts = false\n"),
                   encoding="utf-8")
    with ChatStore(tmp_path / "chats.db") as store:
        fill(store)
        host = ModelHost(warm_up=False, audit=False, history=store)
        assert host.load(str(off)), host.status().error
        assert host.wait_history(30)
        pipe = host.pipeline
        assert pipe.answer_history() is None and pipe.history.answers == 0
        assert pipe.engine("suffix").drafters[0].history is None
        host.remember_answer(pipe, [5, 6, 7], [1, 2])
        assert pipe.history.answers == 0
    assert parse_args([]).no_history_drafts is False
    assert parse_args(["--no-history-drafts"]).no_history_drafts is True
    serve = build_parser().parse_args(["serve", "--save-chats", "--no-history-drafts"])
    assert serve.no_history_drafts is True
    assert build_parser().parse_args(["serve"]).no_history_drafts is False


def test_a_preset_switch_on_the_same_target_keeps_the_history(presets: dict[str, str]) -> None:
    pipe = Pipeline.load(load_preset(presets["ngram"]))
    pipe.remember([[1, 2, 3]])
    again = Pipeline.load(load_preset(presets["draft"]), previous=pipe)
    assert again.target is pipe.target and again.history is pipe.history
    assert Pipeline.load(load_preset(presets["ngram"])).history.answers == 0


def test_the_api_learns_the_answers_it_saves(tmp_path: Path, tiny_presets: dict[str, str]
                                             ) -> None:
    """With a store (``serve --save-chats``) each chat answer is learnt as it finishes; an API
    that saves nothing learns nothing."""
    with ChatStore(tmp_path / "chats.db") as store:
        host = ModelHost(warm_up=False, audit=False, history=store)
        assert host.load(tiny_presets["ngram"]), host.status().error
        messages = [{"role": "user", "content": "def add"}]
        with serving(host) as url:
            OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
                model=host.pipeline.preset.name, messages=messages, max_tokens=6)
        assert host.pipeline.history.answers == 0
        with serving(host, store=store) as url:
            reply = OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
                model=host.pipeline.preset.name, messages=messages, max_tokens=6)
        assert host.pipeline.history.answers == 1  # after the end of its prompt
        assert host.pipeline.history.tokens == reply.usage.completion_tokens + min(
            LEAD_TOKENS, reply.usage.prompt_tokens)


def test_export_maps_suffix_to_vllms_method_and_keys() -> None:
    preset = parse_preset({"name": "s", "description": "d", "hardware": "cpu",
                           "target": {"model": "org/model"},
                           "speculative_config": {"method": "suffix", "num_speculative_tokens": 12,
                                                  "suffix_decoding_max_tree_depth": 32}})
    assert export_vllm(preset).speculative_config == {
        "method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


# ----------------------------------------------------------------------------- bench


def test_bench_history_files(tmp_path: Path) -> None:
    """A JSONL prompt file gives its assistant messages' texts (tool-call turns without text
    left out); a conversations .db its complete answers; anything else is a ConfigError."""
    multiturn = Path(__file__).resolve().parent.parent / "localspec" / "data" / "multiturn.jsonl"
    texts = history_texts(str(multiturn))
    assert len(texts) == 2 and texts[0].startswith("```python") and "Sure" in texts[1]
    with ChatStore(tmp_path / "chats.db") as store:
        fill(store)
    assert history_texts(str(tmp_path / "chats.db")) == ANSWERS
    with pytest.raises(ConfigError, match="no such conversations database"):
        history_texts(str(tmp_path / "missing.db"))
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="no assistant answers"):
        history_texts(str(bare))


def test_bench_runs_a_session_with_its_earlier_answers(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path,
                                                       presets: dict[str, str]) -> None:
    """``--history-session``: the third prompt asks the first's question again, and runs with
    the first's plain answer in the history, so the suffix drafter drafts it whole; alone (no
    history) it cannot. The output is plain decoding's either way."""
    prompts = tmp_path / "session.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"prompt": "print("}, {"prompt": "def add(a, b):"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    reports = {}
    for flags in ((), ("--history-session",)):
        code, out, err = run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                                 str(prompts), "--methods", "suffix", "--max-new-tokens", "12",
                                 "--json", *flags)
        assert code == 0, err
        reports[flags] = json.loads(out)
    session = reports[("--history-session",)]
    assert session["history"] == "history: each prompt's plain answer for the prompts after it"
    assert "history" not in reports[()]
    for report in reports.values():
        assert report["methods"]["suffix"]["identical_to_none"]
    again = session["prompts"][2]["methods"]["suffix"]
    cold = reports[()]["prompts"][2]["methods"]["suffix"]
    assert again["mean_accepted_length"] > cold["mean_accepted_length"]
    assert again["mean_accepted_length"] >= 2  # k = 3: at most 4 tokens a pass


def test_the_app_learns_the_answers_it_saves(tiny: object, tmp_path: Path) -> None:
    """A chat answer the app saved is learnt when it ends; with no history (the flag) it is
    saved all the same and not learnt."""
    from app_helpers import settings

    pipe = tiny.host.pipeline
    with ChatStore(tmp_path / "chats.db") as store:
        tiny.chat.store = store
        for history, learnt in ((None, 0), (store, 1)):
            tiny.host.history = history
            for _ in tiny.chat.send("def add", [], settings(), session="s"):
                pass
            assert pipe.history.answers == learnt
        (answer,) = [m for s in store.list() for m in store.get(s.id).messages
                     if m.role == "assistant"][-1:]
        # its own tokens, after the end of its prompt
        assert pipe.history.tokens == answer.stats["new_tokens"] + LEAD_TOKENS
