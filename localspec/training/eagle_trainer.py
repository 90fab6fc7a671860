"""Training EAGLE and EAGLE-3 heads: the ``HeadTrainer`` their registry entries name.

Shapes and first weights are described in ``training.heads``' module docstring; the losses
(training-time test, EAGLE-1's feature regression) in ``training.losses``. What differs between
the two kinds (the layers read, ``fc``'s width, EAGLE-3's own LM head, d2t/t2d and
``midlayer`` names) follows ``EagleSpec.kind``, as in the drafter and its loader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from localspec.drafters.eagle_head import EagleHead, EagleSpec, RMSNorm, eagle3_layers
from localspec.errors import ConfigError
from localspec.training.heads import HeadShape
from localspec.training.losses import eagle_loss
from localspec.training.target import FrozenTarget


def _uniform(shape: torch.Size, bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, device=generator.device) * 2 - 1) * bound


@dataclass(frozen=True)
class EagleTrainer:
    """``HeadTrainer`` of an EAGLE (``kind`` "eagle") or EAGLE-3 ("eagle3") head."""

    kind: str
    intermediate_ratio: float  # the MLP's default width, x hidden

    def spec(self, config: object, shape: HeadShape, draft_vocab: int) -> EagleSpec:
        """The shape of a new head for a target of ``config`` (sized by ``shape``)."""
        base = EagleSpec.for_target(config, self.kind, draft_vocab_size=draft_vocab)
        heads = max(1, min(shape.attention_heads, base.num_heads))
        kv = min(base.num_kv_heads, heads)
        while heads % kv:
            kv -= 1
        return replace(base, intermediate_size=shape.intermediate(self.intermediate_ratio,
                                                                  base.hidden_size),
                       num_heads=heads, num_kv_heads=kv,
                       target_hidden_size=base.hidden_size if self.kind == "eagle3" else 0)

    @property
    def vocabulary_role(self) -> str:
        """What the training vocabulary is to the head (EAGLE-3's own LM head rows)."""
        return "draft vocabulary" if self.kind == "eagle3" else "training softmax"

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """EAGLE reads the final state; EAGLE-3 fuses layers 2, L // 2 and L - 3."""
        if self.kind != "eagle3":
            return (num_layers,)
        layers = eagle3_layers(num_layers)
        if not all(0 <= i < num_layers for i in layers) or num_layers < 6:
            raise ConfigError(f"EAGLE-3 fuses the target's layers 2, L/2 and L-3, and this "
                              f"target has {num_layers} layers (at least 6 needed): use "
                              "--method eagle")
        return layers

    def new_head(self, target: FrozenTarget, shape: HeadShape, vocab_ids: torch.Tensor,
                 seed: int) -> EagleHead:
        """An untrained float32 head (``training.heads``' module docstring)."""
        device, h = target.device, target.hidden_size
        spec = self.spec(target.runner.config, shape, len(vocab_ids))
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
            block = slice(h, 2 * h) if self.kind == "eagle" else slice(2 * h, 3 * h)
            head.fc.weight[:, block] += torch.eye(h, device=device)
            if head.lm_head is not None:
                head.lm_head.weight.copy_(target.lm_head_rows(vocab_ids))
                head.d2t.copy_(vocab_ids.to(device) - torch.arange(len(vocab_ids),
                                                                   device=device))
                norm = target.final_norm()
                if norm is not None and head.norm is not None:
                    head.norm.weight.copy_(norm)
        return head.train()

    def trained_vocabulary(self, head: EagleHead, vocab_ids: torch.Tensor) -> torch.Tensor:
        """A loaded head's training vocabulary: EAGLE-3's draft ids, else ``vocab_ids``."""
        if head.lm_head is None:
            return vocab_ids
        return head.d2t + torch.arange(len(head.d2t), device=head.d2t.device)

    def loss(self, head: EagleHead, target: FrozenTarget, features: torch.Tensor,
             ids: torch.Tensor, labels: torch.Tensor, lm_rows: torch.Tensor | None,
             to_subset: torch.Tensor, unroll: int) -> tuple[torch.Tensor, float]:
        """``losses.eagle_loss`` of the batch."""
        return eagle_loss(head, features, ids, labels, target.embed(ids), lm_rows, to_subset,
                          unroll)

    def published_tensors(self, head: EagleHead, vocab_size: int) -> dict[str, torch.Tensor]:
        """The state under the published names: EAGLE-3's ``midlayer`` and its t2d."""
        tensors = {}
        for name, tensor in head.state_dict().items():
            if self.kind == "eagle3":
                name = name.replace("layers.0.", "midlayer.", 1)
            tensors[name] = tensor.detach().cpu()
        if self.kind == "eagle3":
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[torch.arange(len(tensors["d2t"])) + tensors["d2t"]] = True
            tensors["t2d"] = t2d
        return tensors

    def config(self, head: EagleHead, layers: tuple[int, ...],
               target_name: str) -> dict[str, object]:
        """config.json as the published heads spell it."""
        s = head.spec
        config = {"architectures": ["LlamaForCausalLMEagle3" if self.kind == "eagle3"
                                    else "LlamaForCausalLM"],
                  "model_type": "llama", "hidden_act": "silu", "hidden_size": s.hidden_size,
                  "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_heads,
                  "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
                  "num_hidden_layers": 1, "rms_norm_eps": s.rms_norm_eps,
                  "vocab_size": s.vocab_size, **dict(s.rope), "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "base_model_name_or_path": target_name}
        if self.kind == "eagle3":
            config.update(draft_vocab_size=s.draft_vocab_size, target_hidden_size=s.hidden_size,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": list(layers),
                                        "use_aux_hidden_state": True})
        return config


EAGLE = EagleTrainer("eagle", 5 / 3)  # 2560 for the 1.5B
EAGLE3 = EagleTrainer("eagle3", 1 / 3)  # 512 for the 1.5B
