"""The flags of the longer subcommands, kept out of ``main`` so that each module reads in one
sitting; torch-free like ``main``, so ``--help`` and flag errors stay fast."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from localspec.config import (
    API_KEY_ENV,
    API_MAX_QUEUED,
    CHATS_FILE,
    DATA_ENV,
    DEFAULT_PRESET,
    MAX_NEW_TOKENS,
    MAX_PARALLEL,
    MAX_SPECULATIVE_TOKENS,
)
from localspec.registry import trainable_methods

API_PORT = 8000  # `serve`'s port for the OpenAI-compatible API (the app mounts it at /v1)
MAX_NUM_SAMPLES = 1000  # `generate --num-samples`
MAX_BENCH_REPEATS = 100  # `bench` and `tune --repeats`
ANSWER_SOURCES: tuple[str, ...] = ("corpus", "target")  # train-drafter's answers: given, own

Handler = Callable[[argparse.Namespace], int]


def count(maximum: int, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum`` (argparse reports it,
    exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {maximum}, got "
                                             f"{value}")
        return value

    return parse


def learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_train_drafter(sub: argparse._SubParsersAction, handler: Handler) -> None:
    """``train-drafter``'s flags (``cli/train_drafter`` runs it)."""
    train = sub.add_parser("train-drafter", help="train an EAGLE, EAGLE-3 or Medusa head for "
                                                 "a target, on this machine")
    train.add_argument("--method", required=True, help=", ".join(trainable_methods()))
    train.add_argument("--target", default=None, metavar="MODEL",
                       help="built-in name, folder, .gguf or Hugging Face repo id")
    train.add_argument("--preset", default=None,
                       help="train on this preset's target as it is served (quantization "
                            "included); --target replaces its model")
    train.add_argument("--out", required=True, metavar="DIR",
                       help="folder for the head (config.json, model.safetensors), its "
                            "checkpoint and training.json")
    train.add_argument("--corpus", action="extend", nargs="+", default=None, metavar="PATH",
                       help=".py/.txt/.md/.rst files, .jsonl requests, folders, or stdlib "
                            "(the Python standard library's sources, the default); several "
                            "are interleaved")
    train.add_argument("--format", choices=("auto", "chat", "raw"), default="auto",
                       help="wrap documents in the target's chat template (auto: when it has "
                            "one) or feed raw text")
    train.add_argument("--answers", choices=ANSWER_SOURCES, default="corpus",
                       help="the documents' answers as written (corpus), or the target's own "
                            "greedy answers to their requests (target: self-distillation, "
                            "generated once and cached; ~30 min for 50k tokens on 2 cores)")
    train.add_argument("--answer-tokens", type=count(MAX_NEW_TOKENS), default=384,
                       help="the longest answer the target writes with --answers target "
                            "(default: %(default)s)")
    train.add_argument("--init", default=None, metavar="HEAD",
                       help="start from this trained head (a folder or built-in head of the "
                            "same method and target) instead of a new one; its sizes and draft "
                            "vocabulary are kept")
    train.add_argument("--tokens", type=count(10**9), default=81_920,
                       help="corpus tokens to compute target features for (~7 min for the "
                            "bundled 1.5B in w8a8 on 2 cores; default: %(default)s)")
    train.add_argument("--steps", type=count(10**7), default=120,
                       help="training steps (~1.5 passes over the default tokens; default: "
                            "%(default)s)")
    train.add_argument("--batch", type=count(4096), default=2,
                       help="chunks per step (default: %(default)s)")
    train.add_argument("--seq-len", type=count(2**20), default=512,
                       help="tokens per chunk (default: %(default)s)")
    train.add_argument("--lr", type=learning_rate, default=1e-3,
                       help="peak learning rate (default: %(default)s)")
    train.add_argument("--unroll", type=count(16, minimum=0), default=3,
                       help="EAGLE: extra draft steps trained on the head's own "
                            "outputs (default: %(default)s)")
    train.add_argument("--intermediate-size", type=count(2**20), default=None,
                       help="EAGLE MLP width (default: hidden x 5/3 for eagle, / 3 for eagle3)")
    train.add_argument("--attention-heads", type=count(1024), default=4,
                       help="EAGLE attention heads, of the target's head size (default: "
                            "%(default)s)")
    train.add_argument("--draft-vocab", type=count(10**7), default=4096,
                       help="EAGLE-3 draft vocabulary; EAGLE/Medusa training softmax "
                            "rows (default: %(default)s)")
    train.add_argument("--heads", type=count(MAX_SPECULATIVE_TOKENS), default=4,
                       help="Medusa heads (default: %(default)s)")
    train.add_argument("--medusa-layers", type=count(8), default=1,
                       help="residual blocks per Medusa head (default: %(default)s)")
    train.add_argument("--eval-prompts", type=count(1000, minimum=0), default=4,
                       help="held-out prompts to measure acceptance on, 0 to skip "
                            "(default: %(default)s)")
    train.add_argument("--eval-tokens", type=count(MAX_NEW_TOKENS), default=64,
                       help="tokens generated per held-out prompt (default: %(default)s)")
    train.add_argument("--eval-k", type=count(MAX_SPECULATIVE_TOKENS), default=5,
                       help="draft length while measuring acceptance (default: %(default)s)")
    train.add_argument("--seed", type=count(2**31, minimum=0), default=0)
    train.add_argument("--checkpoint-every", type=count(10**7), default=25, metavar="STEPS")
    train.add_argument("--resume", action="store_true",
                       help="continue the checkpoint in --out (same settings; --steps may grow)")
    train.add_argument("--json", action="store_true", help="print one JSON object")
    train.set_defaults(func=handler)


def add_gpucheck(sub: argparse._SubParsersAction, handler: Handler) -> None:
    """``gpucheck``'s flags (``cli/gpucheck`` runs it)."""
    gpucheck = sub.add_parser(
        "gpucheck", help="check and measure the GPU engine on this CUDA machine (random "
                         "weights built in place; no network needed); writes a report")
    gpucheck.add_argument("--shapes", choices=("presets", "tiny"), default="presets",
                          help="the presets' model shapes (7B target, 0.5B draft), or tiny "
                               "models that run on any device (to test this command)")
    gpucheck.add_argument("--parts", nargs="+", default=["machine", "correctness", "cost",
                                                         "speculation", "nf4"],
                          help="which parts to run (default: all)")
    gpucheck.add_argument("--out", default="docs", metavar="DIR",
                          help="folder for the report (default: docs)")
    gpucheck.set_defaults(func=handler)


def add_serve(sub: argparse._SubParsersAction, handler: Handler) -> None:
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1) over a preset")
    serve.add_argument("--preset", default=DEFAULT_PRESET,
                       help="a shipped preset (see `localspec presets`) or a .toml path")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=count(65535), default=API_PORT)
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every route (default: "
                            f"${API_KEY_ENV} if set, else no key)")
    serve.add_argument("--max-queued", type=count(1024), default=API_MAX_QUEUED,
                       help="requests held at once, waiting or generating; one more is "
                            f"answered 429 (default {API_MAX_QUEUED})")
    serve.add_argument("--parallel", type=count(MAX_PARALLEL), default=1,
                       help="requests generated at once, their tokens verified in shared "
                            "target passes; each answer is the one it gets alone (default 1)")
    serve.add_argument("--save-chats", action="store_true",
                       help="save each chat request and its answer with the app's "
                            f"conversations (${DATA_ENV}/{CHATS_FILE}; off by default); "
                            "the suffix drafter then also learns from the saved answers")
    serve.add_argument("--no-history-drafts", action="store_true",
                       help="with --save-chats: the suffix drafter reads no saved answers "
                            "(nothing but this request's own text)")
    serve.set_defaults(func=handler)


def add_tune(sub: argparse._SubParsersAction, handler: Handler) -> None:
    """``tune``'s flags (``cli/tune`` runs it)."""
    tune = sub.add_parser("tune", help="measure this machine and save the preset's fastest "
                                       "settings as a preset of yours (a few minutes)")
    tune.add_argument("--preset", default=DEFAULT_PRESET,
                      help="the preset to start from: shipped (see `localspec presets`) or a "
                           ".toml path")
    tune.add_argument("--prompts", default=None,
                      help="JSONL file of your own requests (default: the built-in set)")
    tune.add_argument("--max-new-tokens", type=int, default=64,
                      help="tokens generated per prompt and setting (default 64)")
    tune.add_argument("--repeats", type=count(MAX_BENCH_REPEATS), default=2,
                      help="rounds of the final before/after comparison (default 2)")
    tune.add_argument("--name", default=None,
                      help="the saved preset's name (default: PRESET-tuned)")
    tune.add_argument("--json", action="store_true", help="print one JSON object")
    tune.set_defaults(func=handler)


def add_chats(sub: argparse._SubParsersAction, handler: Handler) -> None:
    """``chats``' subcommands and flags (``cli/chats`` runs them)."""
    chats = sub.add_parser("chats", help="list, show, export and import the app's saved "
                                         f"conversations (in ${DATA_ENV}/{CHATS_FILE})")
    verbs = chats.add_subparsers(dest="verb", required=True)
    conversation = count(2**63 - 1)
    listing = verbs.add_parser("list", help="the conversations, newest first")
    listing.add_argument("--search", default="", metavar="TEXT",
                         help="only those whose title or a message holds TEXT (any case)")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    show = verbs.add_parser("show", help="one conversation, as Markdown")
    show.add_argument("id", type=conversation, metavar="ID", help="its id (`chats list`)")
    show.add_argument("--json", action="store_true", help="print its JSON export instead")
    export = verbs.add_parser("export", help="one conversation, or all, as Markdown or JSON")
    export.add_argument("id", type=conversation, nargs="?", default=None, metavar="ID",
                        help="its id (default: every conversation)")
    export.add_argument("--format", choices=("md", "json"), default="md")
    export.add_argument("--out", default=None, metavar="FILE",
                        help="write to FILE (default: standard output)")
    load = verbs.add_parser("import", help="add the conversations of a JSON export (those "
                                           "already saved are skipped)")
    load.add_argument("file", metavar="FILE")
    for parser in (listing, show, export, load):
        parser.set_defaults(func=handler)


def add_models(sub: argparse._SubParsersAction, handler: Handler) -> None:
    """``models``' actions and flags (``cli/models`` runs them)."""
    models = sub.add_parser("models", help="the model library: list, add (a path or a Hub "
                                           "repo), remove, free its cache, and the drafters "
                                           "that fit a target")
    models.set_defaults(func=handler, json=False)  # no ACTION: list
    actions = models.add_subparsers(dest="models_action", metavar="ACTION")
    listing = actions.add_parser("list", help="every model here: built-in, models folder, "
                                              "added paths, Hugging Face cache (the default)")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    add = actions.add_parser("add", help="add a .gguf file or model folder by path, or "
                                         "download a Hugging Face repo (org/name)")
    add.add_argument("source", metavar="PATH_OR_REPO")
    add.add_argument("--include", action="append", default=None, metavar="PATTERN",
                     help="only the repo's files matching this pattern, e.g. '*Q4_K_M.gguf' "
                          "(repeatable; a GGUF repo with several files needs one)")
    add.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    add.add_argument("--json", action="store_true", help="print one JSON object")
    remove = actions.add_parser("remove", help="forget an added path, or delete a model of "
                                               "the models folder or the Hugging Face cache")
    remove.add_argument("name", metavar="NAME")
    remove.add_argument("--yes", action="store_true",
                        help="really delete files (what it frees is said first without it)")
    free = actions.add_parser("free", help="delete what the cache made from a model (packs, "
                                           "conversions); its own files stay")
    free.add_argument("name", metavar="NAME")
    free.add_argument("--json", action="store_true", help="print one JSON object")
    drafters = actions.add_parser("drafters", help="the drafters that can serve a target here, "
                                                   "with their memory; --make-preset saves one")
    drafters.add_argument("target", metavar="TARGET", help="a model of the library (its name)")
    drafters.add_argument("--make-preset", default=None, metavar="NAME",
                          help="save a preset of the target with a drafter, in your presets "
                               "folder, where --preset NAME and the app find it")
    drafters.add_argument("--drafter", default=None, metavar="KEY",
                          help="the drafter for --make-preset (default: the first that fits)")
    drafters.add_argument("--json", action="store_true", help="print one JSON object")
