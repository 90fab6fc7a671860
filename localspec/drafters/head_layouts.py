"""Published draft-head layouts, read into our modules and checked against the target.

Layouts (key names as the public checkpoints and vLLM's loaders have them):

- EAGLE (``yuhuili/EAGLE-LLaMA3-Instruct-8B``): a Llama config.json; ``fc.weight`` [h, 2h]
  (and ``fc.bias``), ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.N.mlp.{gate,up,down}_proj.weight``, ``layers.N.post_attention_layernorm.weight``,
  ``layers.N.input_layernorm.weight`` for N > 0, sometimes ``embed_tokens.weight`` (ignored:
  the target's embedding is used, as vLLM does). Read with the target's LM head.
- EAGLE-3 (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): config.json with ``draft_vocab_size``
  (and optionally ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``);
  ``fc.weight`` [h, 3h], ``midlayer.*`` (its q/k/v take 2h inputs; ``midlayer.hidden_norm``),
  ``norm.weight``, ``lm_head.weight`` [draft_vocab, h], ``d2t`` (target id = draft id +
  d2t[draft id]) and ``t2d`` [vocab] (bool: which target ids the draft vocabulary has).
- Medusa (``FasterDecoding/medusa-vicuna-7b-v1.3``): config.json with ``medusa_num_heads``,
  ``medusa_num_layers``; ``medusa_lm_head.pt`` with ``{i}.{j}.linear.weight/bias`` (residual
  blocks) and ``{i}.{medusa_num_layers}.weight`` (head i's LM head; absent in the earliest
  heads, which use the target's). vLLM's layout (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``,
  config ``num_heads``, ``num_hidden_layers``) is read too, with its truncated vocabulary:
  ``token_map`` (the target ids the heads guess from) and ``truncated_vocab_size``.

A head made for another target is refused before any weight is copied, saying which of
hidden size, vocabulary or layer count differs and why it matters.

Which loader reads a method's heads, and its name in messages, is the method's registry entry
(``registry.HeadSpec``): ``load_head`` imports the entry's ``load``, so a head method registered
elsewhere (a test's toy) is read the same way. The ``load_*`` functions below are the shipped
methods' entries, all of one signature.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from localspec.drafters.eagle_head import EagleHead, EagleSpec, eagle3_layers
from localspec.drafters.head_files import HeadFiles
from localspec.drafters.medusa_head import MedusaHeads
from localspec.errors import ModelLoadError
from localspec.registry import head_spec
from localspec.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)

ORIGINAL_MEDUSA = re.compile(r"^(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")


# A registered head loader: (files, target, dtype) -> (the head, the target layers it reads).
HeadLoader = Callable[[HeadFiles, ModelRunner, torch.dtype | None],
                      tuple[nn.Module, tuple[int, ...]]]


def load_head(files: HeadFiles, method: str, target: ModelRunner,
              dtype: torch.dtype | None = None) -> tuple[nn.Module, tuple[int, ...]]:
    """A head of ``method`` for ``target`` read by its registered loader (``HeadSpec.load``),
    and the target layers it reads, in ``dtype`` (default: the target's embedding's)."""
    module, _, function = head_spec(method).load.partition(":")
    loader: HeadLoader = getattr(importlib.import_module(module), function)
    return loader(files, target, dtype)


def _refuse(files: HeadFiles, why: str) -> ModelLoadError:
    return ModelLoadError(f"draft head '{files.name}' ({files.where}): {why}")


def _config_int(files: HeadFiles, keys: tuple[str, ...], default: int | None = None) -> int:
    """The first of ``keys`` in config.json, a positive integer (``default`` when absent)."""
    for key in keys:
        value = files.config.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _refuse(files, f"config.json '{key}' must be a positive integer, "
                                     f"got {value!r}")
            return value
    if default is None:
        raise _refuse(files, f"config.json lacks '{keys[0]}'")
    return default


def _wrong_target(files: HeadFiles, what: str, head: object, target: object) -> ModelLoadError:
    return _refuse(files, f"it was made for a target with {what} {head}, and this target's is "
                          f"{target}. A head drafts from its own target's hidden features and "
                          "token ids, so it only works with the model it was trained for: use "
                          "a head published for this target, or train one")


def _load_state(files: HeadFiles, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module`` after checking names and shapes (messages, not
    load_state_dict's tracebacks)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise _refuse(files, f"missing {', '.join(missing[:6])}"
                             f"{' ...' if len(missing) > 6 else ''}: not this kind of head, "
                             "or an incomplete file")
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key].shape):
            raise _refuse(files, f"{key} is {list(tensor.shape)} but its config.json makes it "
                                 f"{list(expected[key].shape)}: the config does not describe "
                                 "these weights")
    ignored = sorted(set(state) - set(expected))
    if ignored:
        logger.warning("draft head %s: ignoring %s", files.name, ", ".join(ignored))
    module.load_state_dict({key: state[key] for key in expected})


# ----------------------------------------------------------------------------- EAGLE


def _eagle_state(files: HeadFiles) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> our names: EAGLE-3's ``midlayer`` is ``layers.0``."""
    state = {}
    for key, tensor in files.tensors.items():
        name = key.removeprefix("model.")
        state[name.replace("midlayer.", "layers.0.", 1)] = tensor
    return state


def _eagle_spec(files: HeadFiles, kind: str, state: dict[str, torch.Tensor],
                target: ModelRunner) -> EagleSpec:
    c = files.config
    if not c:
        raise _refuse(files, f"no config.json in {files.folder}: an {head_spec(kind).label} head "
                             "comes with a Llama-style config")
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse(files, f"activation {c['hidden_act']!r} is not supported (only silu)")
    hidden = _config_int(files, ("hidden_size",))
    heads = _config_int(files, ("num_attention_heads",))
    rope = {key: c[key] for key in ("rope_theta", "rope_scaling", "max_position_embeddings")
            if c.get(key) is not None}
    return EagleSpec(
        kind=kind, hidden_size=hidden, intermediate_size=_config_int(files, ("intermediate_size",)),
        num_heads=heads, num_kv_heads=_config_int(files, ("num_key_value_heads",), heads),
        head_dim=_config_int(files, ("head_dim",), hidden // heads),
        num_layers=_config_int(files, ("num_hidden_layers",), 1),
        rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        vocab_size=_config_int(files, ("vocab_size",), target.vocab_size),
        draft_vocab_size=_config_int(files, ("draft_vocab_size",),
                                     _config_int(files, ("vocab_size",), target.vocab_size)),
        target_hidden_size=_config_int(files, ("target_hidden_size",), hidden),
        attention_bias="layers.0.self_attn.q_proj.bias" in state, fc_bias="fc.bias" in state,
        norm_before_residual=bool(c.get("norm_before_residual", False)), rope=rope)


def _aux_layers(files: HeadFiles, target: ModelRunner) -> tuple[int, ...]:
    """EAGLE-3's target layers: the config's, else (2, L // 2, L - 3); all must exist."""
    eagle_config = files.config.get("eagle_config")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(
        eagle_config, dict) else None
    if ids is None:
        layers = eagle3_layers(target.num_layers)
    elif isinstance(ids, list) and ids and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        layers = tuple(ids)
    else:
        raise _refuse(files, f"eagle_config.eagle_aux_hidden_state_layer_ids must be a list of "
                             f"layer numbers, got {ids!r}")
    if len(layers) != 3 or not all(0 <= i < target.num_layers for i in layers):
        raise _refuse(files, f"it fuses the target's layers {list(layers)}, and this target has "
                             f"{target.num_layers} layers (0..{target.num_layers - 1}): made "
                             "for a deeper model, or a target too shallow for EAGLE-3")
    return layers


def _check_eagle_target(files: HeadFiles, spec: EagleSpec, state: dict[str, torch.Tensor],
                        target: ModelRunner) -> None:
    """Refuse a head of the other EAGLE kind or for another target, with the reason."""
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2:
        raise _refuse(files, "no fc.weight matrix: not an EAGLE head")
    other = "eagle" if spec.kind == "eagle3" else "eagle3"
    if fc.shape[1] != spec.fused_width and fc.shape[1] == replace(spec, kind=other).fused_width:
        raise _refuse(files, f"fc.weight reads {fc.shape[1]} = {fc.shape[1] // spec.hidden_size}"
                             f" x {spec.hidden_size} inputs: this is an {head_spec(other).label} "
                             f"head; set [speculative_config] method = \"{other}\"")
    width = spec.target_hidden_size if spec.kind == "eagle3" else spec.hidden_size
    if width != target.hidden_size:
        raise _wrong_target(files, "hidden size", width, target.hidden_size)
    if spec.vocab_size != target.vocab_size:
        raise _wrong_target(files, "vocabulary size", spec.vocab_size, target.vocab_size)
    embed = state.get("embed_tokens.weight")
    if embed is not None and embed.shape[0] != target.vocab_size:
        raise _wrong_target(files, "vocabulary size (embed_tokens rows)", embed.shape[0],
                            target.vocab_size)
    if spec.kind == "eagle":
        return
    t2d = state.get("t2d")
    if t2d is not None and t2d.shape[0] != target.vocab_size:
        raise _wrong_target(files, "vocabulary size (t2d)", t2d.shape[0], target.vocab_size)
    d2t = state.get("d2t")
    if d2t is None and spec.draft_vocab_size != target.vocab_size:
        raise _refuse(files, f"its LM head has {spec.draft_vocab_size} rows but no d2t maps "
                             "them to the target's token ids")
    if d2t is not None:
        ids = torch.arange(d2t.shape[0]) + d2t.long()
        if d2t.dim() != 1 or d2t.shape[0] != spec.draft_vocab_size or (
                ids.min() < 0 or ids.max() >= target.vocab_size):
            raise _refuse(files, f"d2t must map its {spec.draft_vocab_size} draft ids into "
                                 f"the target's 0..{target.vocab_size - 1}: made for another "
                                 "vocabulary, or damaged")


def load_eagle_head(files: HeadFiles, kind: str, target: ModelRunner,
                    dtype: torch.dtype | None = None) -> tuple[EagleHead, tuple[int, ...] | None]:
    """An EAGLE (``kind`` "eagle") or EAGLE-3 ("eagle3") head for ``target``, and the target
    layers it fuses (EAGLE-3; None for EAGLE), in ``dtype`` (default: the target's
    embedding's) on the target's device."""
    state = _eagle_state(files)
    spec = _eagle_spec(files, kind, state, target)
    _check_eagle_target(files, spec, state, target)
    layers = _aux_layers(files, target) if kind == "eagle3" else None
    if spec.kind == "eagle3" and spec.num_layers != 1:
        raise _refuse(files, f"{spec.num_layers} decoder layers: only one-layer EAGLE-3 heads "
                             "(midlayer) are supported")
    dtype = dtype or target.embedding_weight().dtype
    try:
        head = EagleHead(spec, dtype=dtype, device=target.device)
    except (ValueError, KeyError, TypeError) as exc:  # a rope setting transformers refuses
        raise _refuse(files, f"its config.json cannot be used: {exc}") from exc
    embed = state.pop("embed_tokens.weight", None)
    if kind == "eagle3" and embed is not None:  # its own embedding (EAGLE shares the target's)
        if embed.shape[1] != spec.hidden_size:
            raise _refuse(files, f"embed_tokens is {list(embed.shape)}, its hidden size is "
                                 f"{spec.hidden_size}")
        head.embed_tokens = nn.Embedding.from_pretrained(
            embed.to(device=target.device, dtype=dtype), freeze=True)
    state.pop("t2d", None)
    if kind == "eagle3" and "d2t" not in state:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    _load_state(files, head, state)
    return head.eval().requires_grad_(False), layers


def load_eagle(files: HeadFiles, target: ModelRunner, dtype: torch.dtype | None = None
               ) -> tuple[EagleHead, tuple[int, ...]]:
    """Method "eagle"'s loader: an EAGLE head, reading the target's final state."""
    return load_eagle_head(files, "eagle", target, dtype)[0], (target.num_layers,)


def load_eagle3(files: HeadFiles, target: ModelRunner, dtype: torch.dtype | None = None
                ) -> tuple[EagleHead, tuple[int, ...]]:
    """Method "eagle3"'s loader: an EAGLE-3 head and the three target layers it fuses."""
    head, layers = load_eagle_head(files, "eagle3", target, dtype)
    return head, layers or eagle3_layers(target.num_layers)


# ----------------------------------------------------------------------------- Medusa


def _medusa_state(files: HeadFiles) -> dict[str, torch.Tensor]:
    """Original (``{i}.{j}.linear.*``, ``{i}.{L}.weight``) and vLLM keys -> vLLM's names."""
    state = {}
    for key, tensor in files.tensors.items():
        name = key.removeprefix("medusa_heads.").removeprefix("medusa_head.")
        match = ORIGINAL_MEDUSA.match(name)
        if match and match.group(3):  # a residual block's linear layer
            name = f"blocks.{match.group(1)}.layers.{match.group(2)}.{match.group(4)}"
        elif match and match.group(4) == "weight":  # the head's LM head, after its blocks
            name = f"lm_heads.{match.group(1)}.weight"
        state[name] = tensor
    return state


def load_medusa_heads(files: HeadFiles, target: ModelRunner,
                      dtype: torch.dtype | None = None) -> MedusaHeads:
    """Medusa heads for ``target`` in ``dtype`` (default: the target's embedding's)."""
    state = _medusa_state(files)
    found_heads = {int(key.split(".")[1]) for key in state
                   if key.startswith(("blocks.", "lm_heads."))}
    if not found_heads:
        raise _refuse(files, "no Medusa head tensors ({i}.{j}.linear.weight or "
                             "blocks.{i}.layers.{j}.weight)")
    num_heads = _config_int(files, ("medusa_num_heads", "num_heads"), max(found_heads) + 1)
    layers = {int(key.split(".")[3]) for key in state if key.startswith("blocks.0.layers.")}
    num_layers = _config_int(files, ("medusa_num_layers", "num_hidden_layers"),
                             max(layers) + 1 if layers else 1)
    block = state.get("blocks.0.layers.0.weight")
    hidden = int(block.shape[1]) if block is not None else int(
        state.get("lm_heads.0.weight", torch.empty(0, 0)).shape[1])
    if hidden != target.hidden_size:
        raise _wrong_target(files, "hidden size", hidden, target.hidden_size)
    own = any(key.startswith("lm_heads.") for key in state)
    token_map = state.get("token_map")
    truncated = _check_token_map(files, token_map, target.vocab_size)
    vocab = int(state["lm_heads.0.weight"].shape[0]) if "lm_heads.0.weight" in state else 0
    if own and vocab != (truncated or target.vocab_size):
        raise _wrong_target(files, "vocabulary size", vocab, truncated or target.vocab_size)
    heads = MedusaHeads(hidden, target.vocab_size, num_heads, num_layers, own_lm_heads=own,
                        bias="blocks.0.layers.0.bias" in state, truncated_vocab=truncated,
                        dtype=dtype or target.embedding_weight().dtype, device=target.device)
    _load_state(files, heads, state)
    return heads.eval().requires_grad_(False)


def load_medusa(files: HeadFiles, target: ModelRunner, dtype: torch.dtype | None = None
                ) -> tuple[MedusaHeads, tuple[int, ...]]:
    """Method "medusa"'s loader: Medusa heads, reading the target's final state."""
    return load_medusa_heads(files, target, dtype), (target.num_layers,)


def _check_token_map(files: HeadFiles, token_map: torch.Tensor | None, vocab_size: int) -> int:
    """The size of a Medusa head's ``token_map`` (0 when it has none), refused unless it
    lists distinct target ids: vLLM's truncated draft vocabulary."""
    if token_map is None:
        return 0
    declared = files.config.get("truncated_vocab_size")
    ids = token_map.long() if not token_map.is_floating_point() else None
    if (ids is None or ids.dim() != 1 or not len(ids) or ids.min() < 0
            or ids.max() >= vocab_size or len(torch.unique(ids)) != len(ids)
            or declared not in (None, len(ids))):
        raise _refuse(files, f"token_map must list distinct ids of the target's "
                             f"0..{vocab_size - 1} ({declared or 'as many as'} "
                             "truncated_vocab_size says): made for another vocabulary, or "
                             "damaged")
    return len(ids)
