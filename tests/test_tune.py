"""``localspec tune`` on tiny models: it writes a valid preset of the user's, derived from the one
it started from, and never keeps settings that measured slower than the starting ones."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run_cli

from localspec.errors import ModelLoadError
from localspec.presets import load_preset, user_presets_root
from localspec.training import tuning


@pytest.fixture(autouse=True)
def own_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))


def prompts_file(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "def add(a, b): return a + b\ndef add(a, b): return a + b\n",
        "the cat sat on the mat and the cat sat on the mat")), encoding="utf-8")
    return str(path)


def tune_report(capsys: pytest.CaptureFixture[str], tmp_path: Path, preset: str,
                tokens: int = 4, repeats: int = 1) -> dict:
    """``tune --json`` of ``preset`` on the test prompts (exit status 0): its report."""
    code, out, err = run_cli(capsys, "tune", "--preset", preset, "--prompts",
                             prompts_file(tmp_path), "--max-new-tokens", str(tokens),
                             "--repeats", str(repeats), "--json")
    assert code == 0, err
    return json.loads(out)


def fake_timing(monkeypatch: pytest.MonkeyPatch,
                rate: Callable[[tuning.Settings, int], float],
                differs: Callable[[tuning.Settings], bool] = lambda _s: False) -> None:
    """``tuning.measure`` runs for real, but its seconds come from ``rate`` (tokens a second,
    by settings and how many times they ran), and the first output's last token is changed
    where ``differs``."""
    runs: dict[tuning.Settings, int] = {}
    real = tuning.measure

    def timed(pipe: object, s: tuning.Settings, encoded: list[list[int]], max_new: int,
              into: tuning.Measured | None = None) -> tuning.Measured:
        m = real(pipe, s, encoded, max_new, into)  # type: ignore[arg-type]
        runs[s] = runs.get(s, 0) + 1
        m.seconds = m.tokens / rate(s, runs[s])
        if differs(s):
            m.outputs[0] = [*m.outputs[0][:-1], m.outputs[0][-1] + 1]
        return m

    monkeypatch.setattr(tuning, "measure", timed)


def test_tune_writes_a_valid_preset_never_slower_than_its_start(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tune_report(capsys, tmp_path, presets["draft"], tokens=8)
    name = Path(presets["draft"]).stem + "-tuned"
    assert report["name"] == name and Path(report["saved"]).parent == user_presets_root()
    assert [int(w) for w in report["pass_ms"]] == list(range(1, 18))
    tried = [t["settings"].split(",")[0].split("[")[0] for t in report["trials"]
             if t["stage"] == "method"]
    assert tried == tuning.runnable_methods(load_preset(presets["draft"])), tried
    assert {"none", "ngram", "draft_model"} <= set(tried)
    before, after = report["before"], report["after"]
    assert after["tok_s"] >= before["tok_s"]
    assert after["settings"] == before["settings"] or after["tok_s"] > before["tok_s"]
    saved = load_preset(name)
    assert tuning.settings_of(saved).label() == after["settings"]
    assert saved.target == load_preset(presets["draft"]).target
    text = Path(report["saved"]).read_text(encoding="utf-8")
    assert text.startswith(tuning.MARK) and "draft_dtype" in text  # the source's other keys
    # run again: its own preset is replaced, not refused
    code, _, err = run_cli(capsys, "tune", "--preset", presets["draft"], "--prompts",
                           prompts_file(tmp_path), "--max-new-tokens", "4", "--repeats", "1")
    assert code == 0, err


def test_a_fast_looking_candidate_slower_in_the_final_comparison_is_not_kept(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds faked per setting: k = 16 looks three times as fast in the search (its first
    run) and is half as fast in the before/after rounds: the search picks it, the final rounds
    drop it, and the saved preset keeps the starting settings."""
    fake_timing(monkeypatch, lambda s, run: (300.0 if run == 1 else 50.0) if s.k == 16
                else 100.0)
    report = tune_report(capsys, tmp_path, presets["draft"], tokens=6, repeats=2)
    start = tuning.settings_of(load_preset(presets["draft"]))
    assert report["searched"] == dataclasses.replace(start, k=16).label()
    assert report["after"]["settings"] == start.label()
    assert report["after"]["tok_s"] == pytest.approx(100.0)
    assert tuning.settings_of(load_preset(report["name"])) == start


def test_a_name_held_by_another_preset_is_refused_before_loading(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_loading: None) -> None:
    folder = user_presets_root()
    folder.mkdir(parents=True)
    (folder / "mine.toml").write_text("# my own\n", encoding="utf-8")
    assert_user_error(run_cli(capsys, "tune", "--preset", presets["draft"], "--name", "mine"),
                      "already exists", "did not make it")
    assert (folder / "mine.toml").read_text(encoding="utf-8") == "# my own\n"


def test_settings_round_trip_through_a_preset(presets: dict[str, str]) -> None:
    preset = load_preset(presets["draft"])
    s = dataclasses.replace(tuning.settings_of(preset), k=12, threshold=0.2, lookup_first=True)
    assert tuning.settings_of(tuning.with_settings(preset, s)) == s


def test_an_auto_preset_with_listed_drafters_tunes_every_method(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The members of "auto" are listed only for it: a candidate of another method drops the
    list (else it is no valid preset), and the saved preset keeps it only for auto."""
    text = Path(presets["draft"]).read_text(encoding="utf-8")
    text = text.replace('method = "draft_model"', 'method = "auto"') + \
        'drafters = ["ngram", "draft_model"]\n'
    source = tmp_path / "tiny-auto.toml"
    source.write_text(text, encoding="utf-8")
    preset = load_preset(str(source))
    for method in tuning.runnable_methods(preset):
        s = dataclasses.replace(tuning.settings_of(preset), method=method)
        assert tuning.with_settings(preset, s).speculative_config.method == method
    report = tune_report(capsys, tmp_path, str(source))
    saved = load_preset(report["name"])
    assert ("drafters" in Path(report["saved"]).read_text(encoding="utf-8")) == (
        saved.speculative_config.method == "auto")


def test_autos_member_sets_are_searched_and_written(presets: dict[str, str],
                                                   tmp_path: Path) -> None:
    """With a head beside the draft model, every set of two or more of the three members is a
    candidate; the chosen set is the saved preset's [localspec] drafters."""
    text = Path(presets["draft"]).read_text(encoding="utf-8").replace(
        'method = "draft_model"', 'method = "auto"') + \
        'drafters = ["ngram", "eagle3", "draft_model"]\nhead = "some/head"\n'
    source = tmp_path / "three.toml"
    source.write_text(text, encoding="utf-8")
    preset = load_preset(str(source))
    start = tuning.settings_of(preset)
    assert start.members == ("ngram", "eagle3", "draft_model")
    sets = [s.members for s in tuning.options("auto's drafters", start, ["auto"])]
    assert sets == [("ngram", "eagle3"), ("ngram", "draft_model"), ("eagle3", "draft_model"),
                    ("ngram", "eagle3", "draft_model")]
    pair = dataclasses.replace(start, members=("ngram", "eagle3"))
    assert tuning.settings_of(tuning.with_settings(preset, pair)) == pair
    saved = tuning.tuned_text(text, preset, pair, "# header\n")
    (tmp_path / "saved.toml").write_text(saved, encoding="utf-8")
    again = load_preset(str(tmp_path / "saved.toml"))
    assert again.drafter_set().members == ("ngram", "eagle3") and again.head_source() == "some/head"
    assert again.draft_spec() is None  # no draft model loaded that no member runs
    assert tuning.options("auto's drafters", dataclasses.replace(start, method="ngram"),
                          ["auto"]) == []
    for method in ("none", "ngram", "draft_model", "eagle3"):  # the method stage's candidates
        alone = dataclasses.replace(start, method=method)
        tuned = tuning.with_settings(preset, alone)
        assert tuned.localspec.head is None and tuned.localspec.drafters == ()
        (tmp_path / "alone.toml").write_text(tuning.tuned_text(text, preset, alone, ""),
                                             encoding="utf-8")
        saved_alone = load_preset(str(tmp_path / "alone.toml"))
        assert saved_alone.speculative_config.method == method
        if method == "eagle3":  # a lone head is [speculative_config] model
            assert tuned.head_source() == saved_alone.head_source() == "some/head"


def test_a_setting_whose_output_differs_is_never_chosen(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram lookup made three times as fast, but with an output that differs from plain
    decoding's (as a near-tie on a float path may): reported, not chosen."""
    fake_timing(monkeypatch, lambda s, _run: 300.0 if s.method == "ngram" else 100.0,
                differs=lambda s: s.method == "ngram")
    report = tune_report(capsys, tmp_path, presets["draft"])
    ngram = [t for t in report["trials"] if t["settings"].startswith("ngram")]
    assert ngram and not any(t["identical"] for t in ngram)
    assert not report["searched"].startswith("ngram")


@pytest.mark.parametrize(("name", "needle"), [("../escape", "use letters, digits"),
                                              ("cpu-qwen-coder-draft", "shipped preset")])
def test_a_bad_name_is_refused_before_loading(name: str, needle: str, presets: dict[str, str],
                                              capsys: pytest.CaptureFixture[str],
                                              no_loading: None) -> None:
    assert_user_error(run_cli(capsys, "tune", "--preset", presets["draft"], "--name", name),
                      needle)


def test_the_draft_is_tried_in_each_cpu_form_and_the_fastest_saved(
        presets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds faked so that the draft model wins the method stage and runs fastest as Q4_K:
    every CPU form of the draft is loaded and run for real (outputs compared with plain
    decoding's), one that fails to load is reported and skipped, and the saved preset serves
    the draft as Q4_K."""
    fake_timing(monkeypatch, lambda s, _run: 300.0 if s.draft_quantization == "requant-q4k"
                else 200.0 if s.method == "draft_model" else 100.0)
    real_load = tuning.Pipeline.load

    def load(preset: object, *args: object, **kwargs: object) -> object:
        if preset.speculative_config.quantization == "requant-q3m":  # type: ignore[attr-defined]
            raise ModelLoadError("no room for a third draft")
        return real_load(preset, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tuning.Pipeline, "load", load)
    code, out, err = run_cli(capsys, "tune", "--preset", presets["draft"], "--prompts",
                             prompts_file(tmp_path), "--max-new-tokens", "6", "--repeats", "1",
                             "--json")
    assert code == 0, err
    report = json.loads(out)
    tried = [t for t in report["trials"] if t["stage"] == "draft quantization"]
    assert [t["settings"].rsplit("draft ", 1)[1] for t in tried] == ["none", "w8a8",
                                                                       "requant-q4k"]
    assert all(t["identical"] for t in tried)
    assert "requant-q3m" in err and "no room for a third draft" in err
    saved = load_preset(report["name"])
    assert saved.draft_spec().quantization == "requant-q4k"  # type: ignore[union-attr]
    assert 'quantization = "requant-q4k"' in Path(report["saved"]).read_text(encoding="utf-8")
    assert report["after"]["settings"].endswith("draft requant-q4k")


def test_the_draft_form_stage_only_where_a_cpu_draft_model_runs(
        presets: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in GGUF draft may also keep its own types (w4a8); a folder's may not. The stage
    has no candidates where the draft model does not run, nor for a draft on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" is the CPU here
    shipped = load_preset("cpu-qwen-coder-auto")
    assert tuning.draft_forms(shipped) == ["requant-q3m", "w8a8", "w4a8", "requant-q4k"]
    preset = load_preset(presets["draft"])
    forms = tuning.draft_forms(preset)
    assert forms == ["none", "w8a8", "requant-q4k", "requant-q3m"]
    start = tuning.settings_of(preset)
    assert len(tuning.options("draft quantization", start, [], forms=forms)) == 4
    for method in ("none", "ngram"):
        assert tuning.options("draft quantization", dataclasses.replace(start, method=method),
                              [], forms=forms) == []
    q4k = dataclasses.replace(start, draft_quantization="requant-q4k")
    assert tuning.settings_of(tuning.with_settings(preset, q4k)) == q4k
    gpu = Path(presets["draft"]).read_text(encoding="utf-8").replace('device = "cpu"',
                                                                    'device = "cuda"')
    (tmp_path / "gpu.toml").write_text(gpu.replace('hardware = "cpu"', 'hardware = "gpu-8gb"'),
                                       encoding="utf-8")
    assert tuning.draft_forms(load_preset(str(tmp_path / "gpu.toml"))) == []
