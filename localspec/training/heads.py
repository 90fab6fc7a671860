"""New draft heads for a target: their shape, first weights, size, and the files the drafters'
loaders read (``localspec.drafters.head_layouts``).

Shapes, sized for a budget (the head shipped for the bundled 1.5B must be <= 40 MB):

- ``eagle``: ``fc`` [h, 2h], one decoder layer with ``attention_heads`` heads of the target's
  head size and an MLP of ``intermediate_size``; read through the target's own LM head.
- ``eagle3``: ``fc`` [h, 3h] over three target layers, the same layer (its attention reads 2h),
  a norm and an LM head over a reduced draft vocabulary: the ``draft_vocab`` most frequent
  tokens of the corpus, mapped to the target's ids by ``d2t`` (EAGLE-3's published form).
- ``medusa``: ``medusa_heads`` residual blocks on the last hidden state, all read through the
  target's LM head cut to the ``draft_vocab`` most frequent tokens of the corpus, listed in
  ``token_map`` (vLLM's truncated vocabulary; a Medusa LM head of its own would be [vocab, h]:
  467 MB for the 1.5B).

For the 1.5B (h = 1536, 151,936 tokens) the defaults make eagle3 39.5 MB, eagle 37.8 MB and
medusa 18.9 MB in bfloat16 (3 heads: 14.2 MB). Fewer attention heads than the target's 12 is
what makes room for a useful draft vocabulary: ``fc`` alone is 14 MB.

First weights, drawn from an explicit generator on the target's device: ``fc`` passes the
feature through (identity on the feature's block, small noise elsewhere), the layer's outputs
start small, and EAGLE-3's norm and LM head start as the target's final norm and LM head rows,
so the untrained head already speaks the target's output space. Medusa blocks start as the
identity (Medusa's own choice). Heads are saved as bfloat16 safetensors and config.json.

``--init HEAD`` starts from a trained head instead (to train it further, e.g. on the target's
own answers): read by the drafters' own loader, so a head for another target is refused with
the same message, then made float32 and trainable. Its sizes and (EAGLE-3) draft vocabulary
are kept; a head that fuses other layers than this run's features is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from localspec.drafters.eagle import eagle3_layers
from localspec.drafters.eagle_head import EagleHead, EagleSpec, RMSNorm
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_eagle_head, load_medusa_heads
from localspec.drafters.medusa import MedusaHeads
from localspec.errors import ConfigError, ModelLoadError
from localspec.training.target import FrozenTarget

SAVE_DTYPE = torch.bfloat16
WEIGHTS_FILE = "model.safetensors"
INTERMEDIATE_RATIO = {"eagle": 5 / 3, "eagle3": 1 / 3}  # x hidden: 2560 and 512 for the 1.5B


@dataclass(frozen=True)
class HeadShape:
    """Sizes a user may set; 0 means the default for the method and target."""

    intermediate_size: int = 0
    attention_heads: int = 4
    draft_vocab: int = 4096  # EAGLE-3's LM head rows; the others' training softmax rows
    medusa_heads: int = 4
    medusa_layers: int = 1

    def intermediate(self, method: str, hidden: int) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return max(16, round(hidden * INTERMEDIATE_RATIO[method] / 16) * 16)


def feature_layers(method: str, num_layers: int) -> tuple[int, ...]:
    """The target layers a head of ``method`` reads (runner numbering: ``num_layers`` is the
    final normed state); ConfigError when the target is too shallow for EAGLE-3."""
    if method != "eagle3":
        return (num_layers,)
    layers = eagle3_layers(num_layers)
    if not all(0 <= i < num_layers for i in layers) or num_layers < 6:
        raise ConfigError(f"EAGLE-3 fuses the target's layers 2, L/2 and L-3, and this target "
                          f"has {num_layers} layers (at least 6 needed): use --method eagle")
    return layers


def vocabulary(chunks: list[list[int]], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent token ids of the corpus, ascending, and the share of the
    corpus' tokens they cover (ties broken by id: the same list every run)."""
    counts = _counts(chunks, vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices[:min(size, vocab_size)]
    ids = order.sort().values
    return ids, vocabulary_coverage(chunks, vocab_size, ids, counts)


def _counts(chunks: list[list[int]], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([t for c in chunks for t in c]), minlength=vocab_size)


def vocabulary_coverage(chunks: list[list[int]], vocab_size: int, ids: torch.Tensor,
                        counts: torch.Tensor | None = None) -> float:
    """The share of the corpus' tokens that are among ``ids``."""
    counts = _counts(chunks, vocab_size) if counts is None else counts
    return float(counts[ids.cpu()].sum()) / max(1, int(counts.sum()))


def eagle_spec(method: str, config: object, shape: HeadShape, draft_vocab: int) -> EagleSpec:
    base = EagleSpec.for_target(config, method, draft_vocab_size=draft_vocab)
    heads = max(1, min(shape.attention_heads, base.num_heads))
    kv = min(base.num_kv_heads, heads)
    while heads % kv:
        kv -= 1
    return replace(base, intermediate_size=shape.intermediate(method, base.hidden_size),
                   num_heads=heads, num_kv_heads=kv,
                   target_hidden_size=base.hidden_size if method == "eagle3" else 0)


def _uniform(shape: torch.Size, bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, device=generator.device) * 2 - 1) * bound


def new_head(method: str, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
             seed: int) -> EagleHead | MedusaHeads:
    """An untrained float32 head for ``target`` on its device (see the module docstring)."""
    device, h = target.device, target.hidden_size
    if method == "medusa":
        heads = MedusaHeads(h, target.vocab_size, shape.medusa_heads, shape.medusa_layers,
                            own_lm_heads=False, truncated_vocab=len(vocab_ids), device=device)
        heads.token_map.copy_(vocab_ids)
        return heads.train()
    spec = eagle_spec(method, target.runner.config, shape, len(vocab_ids))
    # Built on "meta" and filled here: nn.Linear's own init would draw from the global RNG.
    head = EagleHead(spec, device="meta").to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, module in head.named_modules():
            if isinstance(module, nn.Linear):
                small = 0.1 if name.endswith(("o_proj", "down_proj", "fc")) else 1.0
                bound = small / math.sqrt(module.in_features)
                module.weight.copy_(_uniform(module.weight.shape, bound, generator))
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        block = slice(h, 2 * h) if method == "eagle" else slice(2 * h, 3 * h)
        head.fc.weight[:, block] += torch.eye(h, device=device)
        if head.lm_head is not None:
            head.lm_head.weight.copy_(target.lm_head_rows(vocab_ids))
            head.d2t.copy_(vocab_ids.to(device) - torch.arange(len(vocab_ids), device=device))
            norm = target.final_norm()
            if norm is not None and head.norm is not None:
                head.norm.weight.copy_(norm)
    return head.train()


def initial_head(name: str, method: str, target: FrozenTarget, layers: tuple[int, ...],
                 vocab_ids: torch.Tensor) -> tuple[EagleHead | MedusaHeads, torch.Tensor]:
    """The trained head ``name`` as a float32 head to train further, and its training
    vocabulary (its own draft vocabulary if it has one: EAGLE-3's, Medusa's ``token_map``;
    otherwise ``vocab_ids``)."""
    files = read_head(name)
    if method == "medusa":
        head: EagleHead | MedusaHeads = load_medusa_heads(files, target.runner, torch.float32)
        if head.token_map is not None:
            vocab_ids = head.token_map.clone()
    else:
        head, fused = load_eagle_head(files, method, target.runner, torch.float32)
        if fused is not None and tuple(fused) != tuple(layers):
            raise ModelLoadError(f"--init {name}: it fuses target layers {list(fused)}, "
                                 f"this run trains on layers {list(layers)}")
        if head.lm_head is not None:
            vocab_ids = head.d2t + torch.arange(len(head.d2t), device=head.d2t.device)
    head.requires_grad_(True)
    if getattr(head, "embed_tokens", None) is not None:  # a published head's own: kept
        head.embed_tokens.requires_grad_(False)
    return head.train(), vocab_ids


def saved_tensors(head: EagleHead | MedusaHeads, method: str,
                  vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names, floats in ``SAVE_DTYPE``."""
    tensors = {}
    for name, tensor in head.state_dict().items():
        if method == "eagle3":
            name = name.replace("layers.0.", "midlayer.", 1)
        value = tensor.detach().cpu()
        tensors[name] = (value.to(SAVE_DTYPE) if value.is_floating_point() else value).contiguous()
    if method == "eagle3":
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(tensors["d2t"])) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
    return tensors


def size_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def head_bytes(head: EagleHead | MedusaHeads, vocab_size: int) -> int:
    """What ``save_head`` will write, from the shapes alone (a head on the "meta" device
    sizes a budget without allocating it): floats as ``SAVE_DTYPE``, EAGLE-3's t2d as bools."""
    total = 0
    for tensor in head.state_dict().values():
        size = SAVE_DTYPE.itemsize if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * size
    return total + (vocab_size if getattr(head, "lm_head", None) is not None else 0)


def head_config(head: EagleHead | MedusaHeads, method: str, layers: tuple[int, ...],
                target_name: str) -> dict[str, object]:
    """config.json as the published heads of ``method`` spell it."""
    if isinstance(head, MedusaHeads):
        config = {"architectures": ["MedusaModel"], "medusa_num_heads": head.num_heads,
                  "medusa_num_layers": len(head.blocks[0].layers),
                  "hidden_size": head.hidden_size, "vocab_size": head.vocab_size,
                  "base_model_name_or_path": target_name}
        if head.token_map is not None:
            config["truncated_vocab_size"] = len(head.token_map)
        return config
    s = head.spec
    config = {"architectures": ["LlamaForCausalLMEagle3" if method == "eagle3"
                                else "LlamaForCausalLM"],
              "model_type": "llama", "hidden_act": "silu", "hidden_size": s.hidden_size,
              "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_heads,
              "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
              "num_hidden_layers": 1, "rms_norm_eps": s.rms_norm_eps, "vocab_size": s.vocab_size,
              **dict(s.rope), "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "base_model_name_or_path": target_name}
    if method == "eagle3":
        config.update(draft_vocab_size=s.draft_vocab_size, target_hidden_size=s.hidden_size,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(layers),
                                    "use_aux_hidden_state": True})
    return config


def save_head(head: EagleHead | MedusaHeads, method: str, folder: Path, layers: tuple[int, ...],
              target_name: str, vocab_size: int) -> int:
    """Write config.json and ``WEIGHTS_FILE`` into ``folder``; the weights' size in bytes."""
    tensors = saved_tensors(head, method, vocab_size)
    config = head_config(head, method, layers, target_name)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    save_file(tensors, folder / WEIGHTS_FILE)
    return size_bytes(tensors)
