"""``localspec gpucheck``: the GPU engine checked and measured in one run, on a CUDA machine
that has no network and no checkpoints (models are built from their configs with random
weights, in place).

Parts, each timed; a part that fails is reported with its error and the others still run:

1. ``machine``: the GPU, its memory, torch / transformers / bitsandbytes versions.
2. ``correctness``: a tiny target and a noisy copy as its draft, on the GPU, float32 and
   bfloat16: greedy speculation equals plain decoding (usual caches, and static caches with
   CUDA graphs); seeded sampling repeats itself; the verifier's chi-square test against the
   target's own next-token distribution.
3. ``cost``: the presets' shapes (Qwen2.5-7B target, Qwen2.5-0.5B draft, bfloat16): ms per
   target pass against tokens fed after a 200-token context, and the draft's one-token step,
   eager against CUDA graphs (with the graphs' one-time compile).
4. ``speculation``: tok/s of plain decoding and of draft_model at simulated acceptance 0.6 and
   0.8 (the draft's real cost; the target's own tokens kept with that probability; output
   exact), eager and with CUDA graphs, k = 5, each warmed up first.
5. ``nf4`` (when bitsandbytes imports): the 8 GB preset's shapes saved once to a temporary
   folder and loaded through the project's loader, then a 4,000-token prompt and 64 new
   tokens: peak memory allocated and reserved against the preset's estimate.

The report goes to ``--out`` (default ``docs/``) as ``gpucheck-<date>-<gpu>.json`` and
``.md``. ``--shapes tiny`` runs every part on tiny shapes on any device: the test suite's way
of running this script without a GPU (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from localspec.cli.check import chi_square_p_value, emitted_token_counts
from localspec.config import parse_preset
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.simulated import SimulatedDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.errors import ConfigError
from localspec.models.hardware import KNOWN_CONFIGS, estimate_preset
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

Log = Callable[[str], None]
SHAPES = {  # (target, draft) as model_configs.json names them; "tiny" is built here
    "presets": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    "tiny": ("tiny", "tiny"),
}
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 8192, "tie_word_embeddings": False}
WIDTHS = (1, 2, 4, 8, 16, 32)
CONTEXT = 200  # tokens in the cache when a pass is timed
K = 5
NEW_TOKENS = 128
STATIC = 4096  # static cache positions (the presets' context)


def _text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(name: str, dtype: torch.dtype, device: torch.device, seed: int
                 ) -> PreTrainedModel:
    """The model of ``name``'s shape (model_configs.json, or TINY) with weights drawn from a
    seeded generator on ``device``: N(0, 0.02) matrices, unit norms, zero biases."""
    fields = TINY if name == "tiny" else json.loads(
        KNOWN_CONFIGS.read_text(encoding="utf-8"))["models"][name]
    config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "hf_repo"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0 if "norm" in key else 0.0)
    return model.eval()


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """A draft that agrees with ``model`` often but not always."""
    copy = random_model("tiny", model.dtype, model.device, seed)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(copy.named_parameters(), model.named_parameters(),
                                          strict=True):
            jitter = torch.randn(mine.shape, generator=generator, device=mine.device,
                                 dtype=torch.float32)
            mine.copy_(theirs * (1 + noise * jitter).to(theirs.dtype))
    return copy


def _runner(model: PreTrainedModel, graphs: bool, **options: Any) -> ModelRunner:
    if graphs:
        return ModelRunner(model, static_cache=STATIC, cuda_graphs=True, **options)
    return ModelRunner(model, **options)


def _tokens(engine: SpeculativeEngine, request: GenerationRequest) -> list[int]:
    return [t for event in engine.generate(request) for t in event.tokens]


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


# ----------------------------------------------------------------------------- parts


def part_machine(device: torch.device, _shapes: str, _log: Log) -> dict[str, Any]:
    versions = {}
    for package in ("torch", "transformers", "bitsandbytes"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
               "cuda": torch.version.cuda}
    return {"device": str(device), "gpu": gpu, "versions": versions}


def part_correctness(device: torch.device, _shapes: str, log: Log) -> dict[str, Any]:
    results: dict[str, Any] = {}
    prompt = _prompt(TINY["vocab_size"], 12, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        target = random_model("tiny", dtype, device, seed=0)
        with torch.no_grad():
            target.lm_head.weight.mul_(400.0)  # peaked logits, as a trained model's
        draft = noisy_copy(target, noise=0.5, seed=2)
        plain = SpeculativeEngine(ModelRunner(target, logits_fp32=True), (), _text, set())
        greedy = GenerationRequest(prompt, max_new_tokens=60, num_speculative_tokens=K,
                                   adaptive=False)
        reference = _tokens(plain, greedy)
        for graphs in (False, True):
            drafter = DraftModelDrafter(_runner(draft, graphs), target_vocab_size=TINY[
                "vocab_size"], tokenizer_vocab_size=TINY["vocab_size"])
            spec = SpeculativeEngine(_runner(target, graphs, logits_fp32=True), (drafter,),
                                     _text, set())
            name = f"{str(dtype).removeprefix('torch.')}{'-graphs' if graphs else ''}"
            sampled = GenerationRequest(prompt, max_new_tokens=30, num_speculative_tokens=K,
                                        sampling=SamplingParams(temperature=1.0), seed=7)
            results[name] = {"greedy_equal": _tokens(spec, greedy) == reference,
                             "sampling_repeats": _tokens(spec, sampled) == _tokens(spec, sampled)}
            log(f"correctness {name}: {results[name]}")
    runner = ModelRunner(random_model("tiny", torch.float32, device, seed=0))
    p = torch.softmax(runner.forward(prompt, logits_to_keep=1)[-1] / 0.02, dim=-1)
    q = torch.softmax(torch.log(p + 1e-9) + torch.randn(
        p.shape, generator=torch.Generator(device=device).manual_seed(3), device=device), -1)
    counts = emitted_token_counts(p, q, trials=20_000, seed=4)
    results["chi_square_p"] = chi_square_p_value(counts.cpu(), p.cpu())
    results["passed"] = all(v["greedy_equal"] and v["sampling_repeats"]
                            for v in results.values() if isinstance(v, dict)) and results[
        "chi_square_p"] > 1e-3
    return results


def _pass_ms(runner: ModelRunner, width: int, vocab: int, repeats: int) -> float:
    """ms of one forward of ``width`` tokens after CONTEXT tokens (rolled back each time)."""
    feed = _prompt(vocab, width, seed=width)
    for _ in range(3):  # warm-up (and, with graphs, capture)
        runner.forward(feed)
        runner.crop(CONTEXT)
    _sync(runner.device)
    began = time.perf_counter()
    for _ in range(repeats):
        runner.forward(feed)
        runner.crop(CONTEXT)
    _sync(runner.device)
    return 1000 * (time.perf_counter() - began) / repeats


def part_cost(device: torch.device, shapes: str, log: Log) -> dict[str, Any]:
    target_name, draft_name = SHAPES[shapes]
    rows: dict[str, Any] = {}
    for role, name, widths in (("target", target_name, WIDTHS), ("draft", draft_name, (1,))):
        model = random_model(name, torch.bfloat16, device, seed=0)
        vocab = model.config.vocab_size
        for graphs in (False, True):
            runner = _runner(model, graphs, logits_fp32=role == "target")
            began = time.perf_counter()
            runner.forward(_prompt(vocab, CONTEXT, seed=0), logits_to_keep=1)
            for width in widths:  # the graphs' compile, once per width
                runner.forward(_prompt(vocab, width, seed=width))
                runner.crop(CONTEXT)
            _sync(device)
            first = time.perf_counter() - began
            key = f"{role}-{'graphs' if graphs else 'eager'}"
            rows[key] = {"model": name, "first_calls_s": round(first, 1), "ms": {
                str(w): round(_pass_ms(runner, w, vocab, repeats=10), 2) for w in widths}}
            log(f"cost {key}: {rows[key]}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_speculation(device: torch.device, shapes: str, log: Log) -> dict[str, Any]:
    target_name, draft_name = SHAPES[shapes]
    target = random_model(target_name, torch.bfloat16, device, seed=0)
    draft = random_model(draft_name, torch.bfloat16, device, seed=1)
    vocab = target.config.vocab_size
    prompt = _prompt(vocab, 100, seed=5)
    request = GenerationRequest(prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=K,
                                adaptive=False)
    results: dict[str, Any] = {}
    for graphs in (False, True):
        mode = "graphs" if graphs else "eager"
        target_runner = _runner(target, graphs, logits_fp32=True)
        draft_runner = _runner(draft, graphs)
        plain = SpeculativeEngine(target_runner, (), _text, set())
        reference = _tokens(plain, request)  # also the warm-up
        runs: list[tuple[str, SpeculativeEngine]] = [("none", plain)]
        for acceptance in (0.6, 0.8):
            drafter = SimulatedDrafter(DraftModelDrafter(
                draft_runner, target_vocab_size=vocab, tokenizer_vocab_size=vocab),
                reference, len(prompt), acceptance)
            runs.append((f"draft_model@{acceptance}", SpeculativeEngine(
                target_runner, (drafter,), _text, set())))
        for name, engine in runs:
            _tokens(engine, request)  # warm-up
            _sync(device)
            began = time.perf_counter()
            tokens = _tokens(engine, request)
            _sync(device)
            seconds = time.perf_counter() - began
            results[f"{name}-{mode}"] = {"tok_s": round(len(tokens) / seconds, 1),
                                         "identical": tokens == reference}
            log(f"speculation {name}-{mode}: {results[f'{name}-{mode}']}")
    for mode in ("eager", "graphs"):
        plain = results[f"none-{mode}"]["tok_s"]
        for acceptance in (0.6, 0.8):
            row = results[f"draft_model@{acceptance}-{mode}"]
            row["speedup"] = round(row["tok_s"] / plain, 2)
    return results


def part_nf4(device: torch.device, shapes: str, log: Log) -> dict[str, Any]:
    if importlib.util.find_spec("bitsandbytes") is None or device.type != "cuda":
        return {"skipped": "needs bitsandbytes and a CUDA device"}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from localspec.pipeline import Pipeline

    target_name, draft_name = SHAPES[shapes]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(["def add(a, b):\n    return a + b\n", "hello world"] * 20,
                                trainers.BpeTrainer(
                                    vocab_size=300, special_tokens=["<|endoftext|>"],
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                    show_progress=False))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        began = time.perf_counter()
        for role, name in (("target", target_name), ("draft", draft_name)):
            model = random_model(name, torch.bfloat16, device, seed=0)
            model.save_pretrained(root / role)
            tokenizer.save_pretrained(root / role)
            del model
        torch.cuda.empty_cache()
        log(f"nf4: models saved in {time.perf_counter() - began:.0f} s")
        preset = parse_preset({
            "name": "gpucheck nf4", "description": "the 8 GB preset's shapes", "hardware":
            "gpu-8gb", "target": {"model": str(root / "target"), "dtype": "bfloat16",
                                  "device": "cuda", "quantization": "bnb-4bit"},
            "speculative_config": {"method": "draft_model", "model": str(root / "draft"),
                                   "num_speculative_tokens": K},
            "localspec": {"draft_dtype": "bfloat16"}})
        estimate = estimate_preset(preset)
        torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        pipe = Pipeline.load(preset)
        loaded = time.perf_counter() - began
        prompt = _prompt(300, 4000, seed=6)
        result = pipe.run(pipe.request(prompt, max_new_tokens=64, temperature=0.0))
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    return {"load_s": round(loaded, 1), "new_tokens": len(result.token_ids),
            "estimate_gib": round(estimate.total / 2**30, 2),
            "peak_allocated_gib": round(allocated / 2**30, 2),
            "peak_reserved_gib": round(reserved / 2**30, 2),
            "reserved_within_10pct": reserved <= 1.1 * estimate.total}


PARTS: dict[str, Callable[[torch.device, str, Log], dict[str, Any]]] = {
    "machine": part_machine, "correctness": part_correctness, "cost": part_cost,
    "speculation": part_speculation, "nf4": part_nf4}


# ----------------------------------------------------------------------------- report


def run_gpucheck(device: torch.device, shapes: str, parts: list[str], log: Log
                 ) -> dict[str, Any]:
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "shapes": shapes}
    for name in parts:
        began = time.perf_counter()
        try:
            report[name] = PARTS[name](device, shapes, log)
        except Exception as exc:  # one part's failure is a finding, not the end of the run
            report[name] = {"error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(limit=8)}
            log(f"{name} failed: {type(exc).__name__}: {exc}")
        report[name]["seconds"] = round(time.perf_counter() - began, 1)
    return report


def format_markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpucheck {report['date']} ({report['shapes']} shapes)", ""]
    machine = report.get("machine", {})
    lines += [f"Machine: `{json.dumps(machine.get('gpu'))}`, "
              f"`{json.dumps(machine.get('versions'))}`", ""]
    for name in PARTS:
        if name in ("machine",) or name not in report:
            continue
        lines += [f"## {name} ({report[name].get('seconds')} s)", "", "```",
                  json.dumps(report[name], indent=1)[:6000], "```", ""]
    cost = report.get("cost", {})
    if "target-eager" in cost and "target-graphs" in cost:
        lines += ["| tokens fed | target eager ms | target graphs ms |", "|---|---|---|"]
        lines += [f"| {w} | {cost['target-eager']['ms'][w]} | {cost['target-graphs']['ms'][w]} |"
                  for w in cost["target-eager"]["ms"]]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    gpu = (report.get("machine", {}).get("gpu") or {}).get("name") or "cpu"
    stem = f"gpucheck-{report['date']}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}"
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    md_path.write_text(format_markdown(report), encoding="utf-8")
    return json_path, md_path


def run_gpucheck_command(args: argparse.Namespace, log: Log) -> int:
    """Check the flags, run the parts, write and name the report."""
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        raise ConfigError(f"--parts {' '.join(unknown)}: choose from {', '.join(PARTS)}")
    if args.shapes == "presets" and not torch.cuda.is_available():
        raise ConfigError("gpucheck measures a CUDA GPU and PyTorch sees none here; "
                          "(--shapes tiny runs its parts on tiny models on any device)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = run_gpucheck(device, args.shapes, args.parts, log)
    json_path, md_path = write_report(report, Path(args.out))
    print(f"gpucheck report: {md_path} and {json_path}")
    problems = [f"{p} failed ({report[p]['error']})" for p in args.parts if "error" in report[p]]
    if report.get("correctness", {}).get("passed") is False:
        problems.append("correctness did not pass")
    if problems:
        print("gpucheck: " + "; ".join(problems))
    return 1 if problems else 0
