"""Training losses of the heads, on a batch of cached chunks (the target is never run here).

Indexing (as the drafters read features): ``labels[t]`` is the target's greedy token after
position t. An EAGLE head at position t reads the feature of token t and the embedding of token
t + 1 and stands in for the feature of token t + 1, so its output is scored on ``labels[t + 1]``
(EAGLE: also regressed onto the feature of t + 1, smooth L1, weight 1 to the token loss' 0.1, as
in the EAGLE paper). Medusa head i reads the feature of token t and is scored on
``labels[t + 1 + i]``, the token after the one the target itself predicts.

Training-time test (EAGLE-3's): drafting feeds the head its own output in place of the feature it
cannot have, so the head is unrolled ``unroll`` extra steps here. Step d at position t reads the
step d - 1 output of position t - 1, the embedding of token t + 1 (teacher forcing), and
attends, as the drafter's KV cache would, to the real (step 0) keys of positions 0..t - d and
the step j keys of position t - d + j for j = 1..d: the chain that drafting from position
t - d builds. Step d's loss is weighted 0.8^d. ``eagle_unroll`` recomputes the head's layer
batched and differentiable from the head's own modules; a test holds it equal to
``EagleHead.forward`` driven as the drafter drives it.

The token losses are cross-entropies over a vocabulary subset: EAGLE-3's draft vocabulary, and
for EAGLE and Medusa the same most frequent ids' rows of the target's LM head (the full
151,936-row head, forward and backward at every unrolled step, would cost several times the
head itself). Positions whose label is outside the subset are left out of the token loss;
drafting still reads the full LM head.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from localspec.drafters.eagle_head import EagleHead
from localspec.drafters.medusa_head import MedusaHeads

STEP_DECAY = 0.8  # weight of unroll step d (and of Medusa head i): 0.8^d
REGRESSION_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE-1's feature and token losses
IGNORE = -100


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, H, n, D] with row t holding row t - by (zeros before the start)."""
    if by == 0:
        return x
    return F.pad(x, (0, 0, by, 0))[:, :, : x.shape[2]]


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
            ) -> torch.Tensor:
    """Step d = len(keys) - 1 attention: q [B, H, n, D] over real keys 0..t - d and the
    diagonal keys of steps 1..d (see the module docstring); returns [B, H, n, D]."""
    d, n = len(keys) - 1, q.shape[2]
    scale = q.shape[-1] ** -0.5
    position = torch.arange(n, device=q.device)
    visible = position[None, :] <= position[:, None] - d  # [n, n]: key j for query t
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))]
    for j in range(1, d + 1):
        scores.append((q * _shift(keys[j], d - j)).sum(-1, keepdim=True) * scale)  # [B,H,n,1]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :n] @ values[0]
    for j in range(1, d + 1):
        out = out + probs[..., n + j - 1 : n + j] * _shift(values[j], d - j)
    return out


def eagle_unroll(head: EagleHead, features: torch.Tensor, embeds: torch.Tensor,
                 unroll: int) -> list[torch.Tensor]:
    """Outputs of steps 0..unroll: each [B, n, h] (pre-norm), n = positions given.

    features: [B, n, W] the target's features of tokens 0..n-1; embeds: [B, n, h] the
    embeddings of tokens 1..n. Rows t < d of step d are not a chain (no loss on them)."""
    layer, spec = head.layers[0], head.spec
    attn = layer.self_attn
    batch, n = features.shape[:2]
    cos, sin = head.rope(0, n, head.fc.weight.dtype)  # [n, head_dim]

    def split(x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, n, heads * D] -> [B, H, n, D]
        x = x.view(batch, n, heads, spec.head_dim).transpose(1, 2)
        return x.repeat_interleave(spec.num_heads // heads, dim=1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for d in range(unroll + 1):
        hidden = features if d == 0 else F.pad(outputs[-1], (0, 0, 1, 0))[:, :n]
        if spec.kind == "eagle":
            x = head.fc(torch.cat((embeds, hidden), dim=-1))
        else:
            x = head.fc(hidden) if d == 0 else hidden
        if layer.two_inputs:
            feature = layer.hidden_norm(x)
            residual = feature if layer.norm_before_residual else x
            attn_in = torch.cat((layer.input_layernorm(embeds), feature), dim=-1)
        else:
            residual, attn_in = x, x
        q = rope(split(attn.q_proj(attn_in), spec.num_heads))
        keys.append(rope(split(attn.k_proj(attn_in), spec.num_kv_heads)))
        values.append(split(attn.v_proj(attn_in), spec.num_kv_heads))
        out = _attend(q, keys, values).transpose(1, 2).reshape(batch, n, -1)
        x = residual + attn.o_proj(out)
        outputs.append(x + layer.mlp(layer.post_attention_layernorm(x)))
    return outputs


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over labelled rows; (loss, right, counted) for top-1 accuracy."""
    labels = labels.reshape(-1)
    logits = logits.reshape(labels.shape[0], -1)
    counted = int((labels != IGNORE).sum())
    if counted == 0:
        return logits.sum() * 0.0, 0, 0
    right = int((logits.argmax(-1) == labels)[labels != IGNORE].sum())
    return F.cross_entropy(logits, labels, ignore_index=IGNORE), right, counted


def eagle_loss(head: EagleHead, features: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
               embed: torch.Tensor, lm_rows: torch.Tensor | None, to_subset: torch.Tensor,
               unroll: int) -> tuple[torch.Tensor, float]:
    """EAGLE / EAGLE-3 loss of a batch; (loss, top-1 accuracy of step 0's tokens).

    features [B, T, W], ids and labels [B, T]; embed: embeddings of ids [B, T, h]; lm_rows:
    the target LM head's subset rows [V', h] (EAGLE; None for EAGLE-3, which has its own);
    to_subset: [vocab] target id -> subset index, or IGNORE."""
    outputs = eagle_unroll(head, features[:, :-1], embed[:, 1:], unroll)
    targets = to_subset[labels[:, 1:]]  # [B, n]
    total = features.new_zeros(())
    weights = 0.0
    accuracy = 0.0
    for d, out in enumerate(outputs):
        chain = targets.clone()
        chain[:, :d] = IGNORE  # rows that are not a d-step chain
        if head.lm_head is not None:
            logits = head.lm_head(head.norm(out))
            loss, right, counted = _token_loss(logits, chain)
        else:
            loss, right, counted = _token_loss(out @ lm_rows.T, chain)
            regression = F.smooth_l1_loss(out[:, d:], features[:, 1 + d:, -out.shape[-1]:])
            loss = REGRESSION_WEIGHT * regression + TOKEN_WEIGHT * loss
        total = total + STEP_DECAY**d * loss
        weights += STEP_DECAY**d
        if d == 0:
            accuracy = right / max(1, counted)
    return total / weights, accuracy


def medusa_loss(heads: MedusaHeads, features: torch.Tensor, labels: torch.Tensor,
                lm_rows: torch.Tensor, to_subset: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Medusa loss of a batch; (loss, top-1 accuracy of head 0). features [B, T, h]."""
    total = features.new_zeros(())
    weights = 0.0
    accuracy = 0.0
    for i in range(heads.num_heads):
        n = features.shape[1] - 1 - i
        if n <= 0:
            break
        logits = heads.head_hidden(i, features[:, :n]) @ lm_rows.T  # [B, n, V']
        loss, right, counted = _token_loss(logits, to_subset[labels[:, 1 + i:]])
        total = total + STEP_DECAY**i * loss
        weights += STEP_DECAY**i
        if i == 0:
            accuracy = right / max(1, counted)
    return total / max(weights, 1e-9), accuracy
