"""The Medusa heads as a PyTorch module: K stacks of residual blocks on the target's final
hidden state, each with an LM head of its own or none (then the target's, cut to ``token_map``).

Each head is a stack of residual blocks ``x + SiLU(W x + b)``, initialised to the identity
(W = 0, b = 0), as Medusa (Cai et al., 2024) does. Names follow vLLM's Medusa layout; this
module holds no weights loader (``head_layouts``) and no drafting (``medusa``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ResidualBlock(nn.Module):
    """``num_layers`` times ``x = x + SiLU(layer(x))``; the identity when initialised."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool = True,
                 **factory: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias, **factory)
                                    for _ in range(num_layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.zero_()
                if layer.bias is not None:
                    layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K heads: ``blocks[i]`` then ``lm_heads[i]`` (None: the target's LM head for all).

    Names follow vLLM's Medusa layout (``blocks.i.layers.j``, ``lm_heads.i``, ``token_map``);
    the original ``medusa_lm_head.pt`` keys are mapped onto them by ``head_layouts``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_heads: bool = True, bias: bool = True, truncated_vocab: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        """``truncated_vocab``: the size of ``token_map`` (0: the whole vocabulary)."""
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, vocab_size, dtype
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias, **factory)
                                    for _ in range(num_heads))
        # [truncated_vocab] distinct target ids, or None
        self.register_buffer("token_map", torch.arange(truncated_vocab, device=device)
                             if truncated_vocab else None)
        self.lm_heads: nn.ModuleList | None = None
        if own_lm_heads:
            rows = truncated_vocab or vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False, **factory)
                                          for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_hidden(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i's input to its LM head: [n, hidden] -> [n, hidden]."""
        return self.blocks[i](hidden.to(self.dtype))
