"""Shared fixtures for the unit tests: tiny random Qwen2 models, runners, a toy decoder, tiny
presets, and the app over them.

No real checkpoint is ever loaded here. The random models are scaled so that their logits are
peaked (stable greedy argmaxes, informative sampling) and kept tiny (one thread each) so that a
test over them takes well under a second.

Two lanes (lanes.py): ``python3 -m pytest`` runs everything, as CI does, in about 20 minutes on
two CPU cores (the built-in models, a real browser, kernel builds from scratch, subprocesses);
``python3 -m pytest -m "not slow"`` leaves those out and runs in a few minutes.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

from localspec.cli.main import main
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.drafter import Drafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine, StepEvent
from localspec.runtime.runner import ModelRunner

if TYPE_CHECKING:
    from localspec.ui.app import ChatApp

# The fast lane's marks (lanes.py) and the shared folders and kernels (shared_fixtures.py).
pytest_plugins = ["lanes", "shared_fixtures"]

VOCAB = 97
PADDED_VOCAB = 101
MAX_POSITIONS = 256
TOKENIZER_VOCAB = 300  # the saved models below use a real (byte-level BPE) tokenizer


def tiny_config(vocab_size: int = VOCAB, max_positions: int = MAX_POSITIONS) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def make_tiny_model(seed: int, vocab_size: int = VOCAB,
                    head_scale: float = 20.0) -> PreTrainedModel:
    """A random tiny Qwen2 in float32, eval mode, LM head scaled so logits are peaked."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def perturbed_copy(model: PreTrainedModel, seed: int, noise: float,
                   vocab_size: int | None = None) -> PreTrainedModel:
    """A copy of ``model`` with relative Gaussian noise on every weight: a draft that agrees
    with the target often but not always. ``vocab_size`` larger than the model's pads the
    embedding and LM head with extra rows (filled in by the caller)."""
    vocab = vocab_size or model.config.vocab_size
    copy = AutoModelForCausalLM.from_config(tiny_config(vocab), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    source = model.state_dict()
    with torch.no_grad():
        for name, param in copy.state_dict().items():
            src = source[name]
            rows = min(src.shape[0], param.shape[0]) if src.dim() else 0
            value = src.clone()
            if value.is_floating_point() and value.numel() > 1:
                value += noise * value.std() * torch.randn(value.shape, generator=generator)
            if src.dim() and src.shape != param.shape:
                param[:rows] = value[:rows]
            else:
                param.copy_(value)
    return copy


def decode(ids: list[int]) -> str:
    """A toy tokenizer: token i is the letter chr(65 + i % 26)."""
    return "".join(chr(65 + i % 26) for i in ids)


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE (as Qwen2 uses) of TOKENIZER_VOCAB tokens, trained offline."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


TOKENIZER_TEXTS = ["def add(a, b):\n    return a + b\n", "hello world"]


@pytest.fixture(scope="session")
def saved_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 and its tokenizer in save_pretrained layout (safetensors)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    train_tokenizer(TOKENIZER_TEXTS).save_pretrained(folder)
    make_tiny_model(seed=0, vocab_size=TOKENIZER_VOCAB).save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    return folder


@pytest.fixture(autouse=True, scope="session")
def _own_data_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test, and no app a test starts, saves conversations in the user's data folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCALSPEC_DATA", str(tmp_path_factory.mktemp("data")))
        yield


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads and lose a lot to contention on a busy
    machine (7x slower here); real-model tests keep torch's default."""
    if request.node.get_closest_marker("real_model") is not None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target_model() -> PreTrainedModel:
    return make_tiny_model(seed=0)


@pytest.fixture(scope="session")
def random_draft_model() -> PreTrainedModel:
    """Independent random weights: almost never agrees with the target."""
    return make_tiny_model(seed=1)


@pytest.fixture(scope="session")
def close_draft_model(target_model: PreTrainedModel) -> PreTrainedModel:
    """The target plus noise: agrees part of the time (acceptances and rejections both occur)."""
    return perturbed_copy(target_model, seed=2, noise=0.5)


@pytest.fixture(scope="session")
def padded_draft_model(target_model: PreTrainedModel) -> PreTrainedModel:
    """A close draft whose vocabulary is padded to 101 rows; the padding rows are rigged to win
    the argmax often, so a drafter that forgot to mask them would propose ids >= 97."""
    model = perturbed_copy(target_model, seed=3, noise=0.3, vocab_size=PADDED_VOCAB)
    with torch.no_grad():
        head = model.lm_head.weight
        for i, row in enumerate(range(VOCAB, PADDED_VOCAB)):
            head[row] = 10.0 * head[i * 7]
    return model


@pytest.fixture
def target_runner(target_model: PreTrainedModel) -> ModelRunner:
    return ModelRunner(target_model)


@pytest.fixture
def toy_decode() -> Callable[[list[int]], str]:
    return decode


def collect(engine: SpeculativeEngine, request: GenerationRequest,
            cancelled: Callable[[], bool] | None = None) -> tuple[list[int], list[StepEvent]]:
    """Run a generation to the end; return the token ids and the events."""
    stream = engine.generate(request) if cancelled is None else engine.generate(request, cancelled)
    events = list(stream)
    return [t for e in events for t in e.tokens], events


def draft_drafter(model: PreTrainedModel, threshold: float = 0.0,
                  tokenizer_vocab: int = VOCAB) -> DraftModelDrafter:
    return DraftModelDrafter(ModelRunner(model), target_vocab_size=VOCAB,
                             tokenizer_vocab_size=tokenizer_vocab,
                             confidence_threshold=threshold)


@pytest.fixture
def make_drafter(target_model: PreTrainedModel, random_draft_model: PreTrainedModel,
                 close_draft_model: PreTrainedModel, padded_draft_model: PreTrainedModel
                 ) -> Callable[[str], tuple[Drafter, ...]]:
    """An engine's drafters by kind over the tiny models, fresh for each call (the engine
    tests' drafters: n-gram lookup, draft models random, close, padded, the target itself, and
    lookup in front of the close draft model)."""
    def make(kind: str) -> tuple[Drafter, ...]:
        return {
            "ngram": lambda: (NgramDrafter(prompt_lookup_max=4, prompt_lookup_min=1),),
            "random-draft": lambda: (draft_drafter(random_draft_model),),
            "close-draft": lambda: (draft_drafter(close_draft_model),),
            "close-draft-threshold": lambda: (draft_drafter(close_draft_model, threshold=0.3),),
            "self-draft": lambda: (draft_drafter(target_model),),
            "padded-draft": lambda: (draft_drafter(padded_draft_model),),
            "lookup-first": lambda: (NgramDrafter(3, 2), draft_drafter(close_draft_model)),
        }[kind]()

    return make


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real one-layer Qwen2 GGUF file (transformers converts it in a fraction of a second)."""
    from model_files import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


# ----------------------------------------------------------------------------- tiny presets

# A minimal chat template that, like real ones, refuses roles it does not know.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PRESET = """\
name = "{name}"
description = "tiny random models"
hardware = "cpu"
target = {{ model = "{target}", dtype = "float32", device = "cpu" }}
speculative_config = {{ method = "{method}", num_speculative_tokens = {k}{draft} }}
sampling = {{ max_new_tokens = {max_new_tokens} }}

[localspec]
draft_dtype = "float32"
draft_confidence_threshold = 0.0
adaptive_k = {adaptive}
lookup_first = {lookup_first}
"""


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A target and a close draft sharing a byte-level tokenizer with a chat template."""
    root = tmp_path_factory.mktemp("cli-models")
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    target = make_tiny_model(seed=0, vocab_size=300)
    folders = {}
    for name, model in (("target", target), ("draft", perturbed_copy(target, seed=4, noise=0.3))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def write_preset(folder: Path, target: Path, draft: Path | None = None, method: str | None = None,
                 k: int = 3, max_new_tokens: int = 8, adaptive: bool = True,
                 lookup_first: bool = False) -> str:
    """A preset file for ``target`` (draft_model with ``draft``, else ngram, unless ``method``
    says otherwise); its path."""
    method = method or ("draft_model" if draft else "ngram")
    path = folder / f"tiny-{method}{'-lookup-first' if lookup_first else ''}.toml"
    path.write_text(PRESET.format(name=f"tiny {method}", target=target, method=method, k=k,
                                  max_new_tokens=max_new_tokens, adaptive=str(adaptive).lower(),
                                  lookup_first=str(lookup_first).lower(),
                                  draft=f', model = "{draft}"' if draft else ""),
                    encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def presets(tiny_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
            saved_model_dir: Path) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("cli-presets")
    plain = folder / "plain"
    plain.mkdir()
    return {"draft": write_preset(folder, tiny_folders["target"], tiny_folders["draft"]),
            "ngram": write_preset(folder, tiny_folders["target"]),
            "no-template": write_preset(plain, saved_model_dir)}


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the command loudly: proves a check came before loading."""
    from localspec.pipeline import Pipeline

    def refuse(*_args: object, **_kwargs: object) -> Pipeline:
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(Pipeline, "load", refuse)


def run_cli(capsys: pytest.CaptureFixture[str] | None, *args: str) -> tuple[int, str, str]:
    """main(args) in-process: (exit status, stdout, stderr); argparse's exits included. Without
    ``capsys`` the output is captured here."""
    out, err = io.StringIO(), io.StringIO()
    with (contextlib.nullcontext() if capsys else contextlib.redirect_stdout(out),
          contextlib.nullcontext() if capsys else contextlib.redirect_stderr(err)):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return (code, *capsys.readouterr()) if capsys else (code, out.getvalue(), err.getvalue())


def assert_user_error(result: tuple[int, str, str], *needles: str) -> None:
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err
    last = err.replace("\r", "\n").strip().splitlines()[-1]  # after any progress bar
    assert last.startswith("localspec: error: ") and err.count("localspec:") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


# ----------------------------------------------------------------------------- the app


@pytest.fixture
def expects_bug() -> None:
    """Marks a test that injects a bug: an ERROR with its traceback is expected in the log."""


@pytest.fixture
def no_errors_logged(caplog: pytest.LogCaptureFixture,
                     request: pytest.FixtureRequest) -> Iterator[None]:
    """A traceback in the server log is a failure, unless the test expects a bug (the app's test
    modules use it on every test)."""
    yield
    if "expects_bug" not in request.fixturenames:
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]


@pytest.fixture(scope="session")
def tiny_presets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Preset files over a tiny target: n-gram, plain, and a random (always wrong) draft."""
    root = tmp_path_factory.mktemp("ui-tiny")
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    for name, seed in (("target", 0), ("draft", 1)):
        make_tiny_model(seed=seed, vocab_size=300).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {key: write_preset(root, root / "target", draft, method, k=4, max_new_tokens=12,
                              adaptive=False)
            for key, method, draft in (("ngram", "ngram", None), ("plain", "none", None),
                                       ("draft", "draft_model", root / "draft"))}


@pytest.fixture
def tiny(tiny_presets: dict[str, str]) -> ChatApp:
    """The app with the tiny n-gram preset loaded, a fresh host for each test (imported here,
    not at the top: the other tests need no Gradio)."""
    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import ChatApp

    host = ModelHost(warm_up=False)
    assert host.load(tiny_presets["ngram"]), host.status().error
    # The tests drive the answers' generators from the calling thread, so a Stop there could
    # only time out waiting for them to end: it does not wait.
    return ChatApp(host, detect_hardware(), tiny_presets["ngram"], min_update_interval=0.0,
                   stop_wait_s=0.0)
