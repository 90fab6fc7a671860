"""Presets: every shipped file validates, and every kind of mistake gets a message that names the
file, the key and what would be accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.pipeline import request_settings_for
from localspec.presets import (
    DEFAULT_PRESET,
    Preset,
    PresetError,
    list_preset_names,
    load_preset,
    parse_preset,
    presets_dir,
    shipped_preset_names,
)

MINIMAL = """\
name = "test"
description = "a test preset"
hardware = "cpu"

[target]
model = "some-org/some-model"
"""

FULL = """\
name = "test"
description = "a test preset"
hardware = "cpu"

[target]
model = "some-org/some-model"
dtype = "float32"
device = "cpu"

[speculative_config]
method = "{method}"
{model_line}
num_speculative_tokens = {k}
prompt_lookup_max = 4
prompt_lookup_min = 2

[sampling]
temperature = 0.7
top_p = 0.9
top_k = 20
max_new_tokens = 64
seed = 3

[localspec]
adaptive_k = false
draft_confidence_threshold = 0.25
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def full(method: str = "draft_model", model: str | None = "some-org/draft", k: int = 5) -> str:
    model_line = f'model = "{model}"' if model is not None else ""
    return FULL.format(method=method, model_line=model_line, k=k)


def test_shipped_presets_exist_and_include_default() -> None:
    """presets/ is found next to the package and holds the default preset."""
    names = list_preset_names()
    assert len(names) >= 3
    assert DEFAULT_PRESET in names


# shipped ones only: collected before the tests' own data folder is set, where the user's
# presets (one `tune` saved, say) would join them
@pytest.mark.parametrize("name", shipped_preset_names())
def test_shipped_preset_loads(name: str) -> None:
    """Each shipped preset parses, validates and describes a usable configuration."""
    preset = load_preset(name)
    assert isinstance(preset, Preset)
    assert preset.path == presets_dir() / f"{name}.toml"
    assert preset.name and preset.description
    assert preset.target_spec().model == preset.target.model
    sc = preset.speculative_config
    if "draft_model" in preset.drafter_set().members:  # "auto" sets too
        draft = preset.draft_spec()
        assert draft is not None and draft.model == sc.model
        assert draft.device == preset.target.device
    assert load_preset(f"{name}.toml") == preset


def test_full_preset_round_trip(tmp_path: Path) -> None:
    """Every key of every table is read into the dataclasses."""
    preset = load_preset(str(write(tmp_path, full())))
    assert preset.target.dtype == "float32" and preset.target.device == "cpu"
    assert preset.speculative_config.model == "some-org/draft"
    assert preset.speculative_config.prompt_lookup_min == 2
    assert preset.sampling.temperature == 0.7 and preset.sampling.top_k == 20
    assert preset.sampling.seed == 3
    assert preset.localspec.adaptive_k is False
    assert preset.localspec.draft_confidence_threshold == 0.25
    draft = preset.draft_spec()
    assert draft is not None and draft.model == "some-org/draft"


def test_tree_width_reaches_the_request(tmp_path: Path) -> None:
    """``[localspec] tree_width``: 1 (a chain) unless the preset says otherwise, and what the
    pipeline puts in each request."""
    assert load_preset(str(write(tmp_path, MINIMAL))).localspec.tree_width == 1
    text = full().replace("draft_confidence_threshold = 0.25", "tree_width = 3")
    preset = load_preset(str(write(tmp_path, text, "wide.toml")))
    assert preset.localspec.tree_width == 3
    assert request_settings_for(preset).tree_width == 3


def test_minimal_preset_defaults(tmp_path: Path) -> None:
    """Only [target] model is required; everything else has defaults (plain decoding)."""
    preset = load_preset(str(write(tmp_path, MINIMAL)))
    assert preset.speculative_config.method == "none"
    assert preset.draft_spec() is None
    assert preset.sampling.temperature == 0.0


def test_a_gguf_gets_the_native_path_unless_told_otherwise(tmp_path: Path) -> None:
    """No quantization key on a .gguf target or draft: the native CPU path (w4a8), as the
    app and `models drafters --make-preset` would choose; a named one, or CUDA, is kept."""
    text = ('name = "g"\ndescription = "d"\nhardware = "cpu"\n'
            '[target]\nmodel = "/m/Target-Q5_K_M.GGUF"\n[speculative_config]\n'
            'method = "draft_model"\nmodel = "/m/draft.gguf"\n')
    preset = load_preset(str(write(tmp_path, text)))
    assert preset.target.quantization == "w4a8" and preset.speculative_config.quantization == "w4a8"
    named = text.replace('GGUF"\n', 'GGUF"\nquantization = "none"\n', 1)
    assert load_preset(str(write(tmp_path, named))).target.quantization == "none"
    cuda = text.replace('GGUF"\n', 'GGUF"\ndevice = "cuda"\n', 1)
    assert load_preset(str(write(tmp_path, cuda))).target.quantization == "none"
    assert load_preset(str(write(tmp_path, MINIMAL))).target.quantization == "none"


def test_integer_accepted_for_float(tmp_path: Path) -> None:
    """temperature = 1 (a TOML integer) is a valid float."""
    preset = load_preset(str(write(tmp_path, MINIMAL + "\n[sampling]\ntemperature = 1\n")))
    assert preset.sampling.temperature == 1


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (MINIMAL.replace('hardware = "cpu"\n', 'hardware = "cpu"\ncolour = "blue"\n'),
         ["unknown key 'colour'", "allowed: name, description, hardware, target",
          "speculative_config"]),
        (MINIMAL + 'colour = 1\n', ["[target]: unknown key 'colour'", "allowed: model, dtype"]),
        (full().replace("seed = 3", "seed = 3\nbeam = 2"),
         ["[sampling]: unknown key 'beam'", "allowed: temperature"]),
        (full(k='"five"'), ["num_speculative_tokens = 'five'", "valid integer"]),
        (full().replace("adaptive_k = false", 'adaptive_k = "no"'),
         ["[localspec] adaptive_k = 'no'", "valid boolean"]),
        (full().replace("top_k = 20", "top_k = true"),
         ["[sampling] top_k = True", "valid integer"]),
        (full().replace("temperature = 0.7", 'temperature = "hot"'),
         ["[sampling] temperature = 'hot'", "valid number"]),
        (full(method="lookahead"),
         ["method = 'lookahead' is not one of",
          "'none', 'draft_model', 'ngram', 'suffix', 'eagle3', 'eagle', 'medusa' or 'auto'"]),
        (full(method="eagle3", model=None), ["method 'eagle3' needs 'model' (the draft head"]),
        (full(model=None), ["method 'draft_model' needs 'model'"]),
        (full(k=0), ["num_speculative_tokens = 0", "greater than or equal to 1"]),
        (full(k=33), ["num_speculative_tokens = 33", "less than or equal to 32"]),
        (full().replace("prompt_lookup_min = 2", "prompt_lookup_min = 6"),
         ["prompt_lookup_min <= prompt_lookup_max"]),
        (full().replace("top_p = 0.9", "top_p = 1.5"),
         ["[sampling] top_p = 1.5", "less than or equal to 1"]),
        (full().replace("max_new_tokens = 64", "max_new_tokens = 0"),
         ["[sampling] max_new_tokens = 0", "greater than or equal to 1"]),
        (full().replace("draft_confidence_threshold = 0.25", "draft_confidence_threshold = 1.0"),
         ["draft_confidence_threshold = 1.0", "less than 1"]),
        (full().replace("draft_confidence_threshold = 0.25", "tree_width = 0"),
         ["[localspec] tree_width = 0", "greater than or equal to 1"]),
        (full().replace("draft_confidence_threshold = 0.25", "tree_width = 9"),
         ["[localspec] tree_width = 9", "less than or equal to 8"]),
        (MINIMAL.replace('"cpu"', '"abacus"'), ["hardware = 'abacus' is not one of", "gpu-8gb"]),
        (full().replace('dtype = "float32"', 'dtype = "int3"'),
         ["[target] dtype = 'int3' is not one of", "bfloat16"]),
        (full().replace('device = "cpu"', 'device = "tpu"'), ["[target] device = 'tpu'"]),
        (MINIMAL + 'quantization = "gptq"\n', ["[target] quantization = 'gptq'", "bnb-4bit"]),
        (MINIMAL.replace('name = "test"\n', ""), ["missing required key 'name'"]),
        (MINIMAL.replace('description = "a test preset"', 'description = ""'),
         ["description = ''", "at least 1 character"]),
        ('name = "x"\ndescription = "y"\nhardware = "cpu"\n', ["missing required key 'target'"]),
        ('name = "x"\ndescription = "y"\nhardware = "cpu"\ntarget = "m"\n',
         ["[target] must be a table"]),
    ],
    ids=["top-level-key", "table-key", "table-key-sampling", "type-int", "type-bool",
         "type-int-not-bool", "type-float", "method", "head-without-model",
         "draft-without-model", "k-0", "k-33",
         "lookup-min-max", "top-p", "max-new-tokens", "threshold", "tree-width-0",
         "tree-width-9", "hardware", "dtype", "device",
         "quantization", "no-name", "empty-description", "no-target", "target-not-table"],
)
def test_invalid_preset_messages(tmp_path: Path, text: str, fragments: list[str]) -> None:
    """Each mistake raises PresetError naming the file and the offending key/value."""
    path = write(tmp_path, text)
    with pytest.raises(PresetError) as info:
        load_preset(str(path))
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_invalid_toml(tmp_path: Path) -> None:
    """A syntax error is reported as 'not valid TOML' with the file name."""
    path = write(tmp_path, 'name = "unterminated\n')
    with pytest.raises(PresetError, match="not valid TOML") as info:
        load_preset(str(path))
    assert str(path) in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a PresetError too, not a crash."""
    path = tmp_path / "bad.toml"
    path.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(PresetError, match="line 1: not UTF-8 text"):
        load_preset(str(path))


def test_unknown_preset_lists_available() -> None:
    """An unknown name says so and lists every shipped preset."""
    with pytest.raises(PresetError, match="unknown preset 'no-such-preset'") as info:
        load_preset("no-such-preset")
    for name in list_preset_names():
        assert name in str(info.value)


def test_missing_toml_path_is_no_such_file(tmp_path: Path) -> None:
    """A .toml path that does not exist is reported as missing, not opened."""
    absent = tmp_path / "absent.toml"
    with pytest.raises(PresetError, match=f"^{absent}: no such file$"):
        load_preset(str(absent))


def test_parse_preset_where_prefix() -> None:
    """parse_preset works on an already-parsed dict and prefixes messages with ``where``."""
    with pytest.raises(PresetError, match=r"^inline: missing required key 'description'.*'target'"):
        parse_preset({"name": "x"}, where="inline")


def test_target_without_model(tmp_path: Path) -> None:
    """[target] without its required 'model' key is a PresetError that names the key."""
    path = write(tmp_path, MINIMAL.replace('model = "some-org/some-model"', 'dtype = "float32"'))
    with pytest.raises(PresetError, match="model"):
        load_preset(str(path))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_temperature_refused(tmp_path: Path, value: str) -> None:
    """temperature = nan passed `nan < 0` before; a finite number is now required."""
    path = write(tmp_path, full().replace("temperature = 0.7", f"temperature = {value}"))
    with pytest.raises(PresetError, match="temperature") as info:
        load_preset(str(path))
    assert "finite" in str(info.value)


def test_config_module_is_torch_free() -> None:
    """Reading presets must not import torch (it costs seconds at start-up)."""
    import subprocess
    import sys

    code = ("import sys, localspec.presets as p; [p.load_preset(n) for n in p.list_preset_names()];"
            " print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
