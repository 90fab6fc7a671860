"""The verifier: pure functions that decide which draft tokens the target keeps.

Vocabulary (as in vLLM's rejection sampler):
  * **accepted** draft tokens: the prefix of the draft the target agrees with;
  * a **recovered** token: sampled from the residual ``norm(max(0, p - q))`` (or the
    target's argmax, greedily) at the first rejected position;
  * a **bonus** token: sampled from ``p`` at position ``k`` once all ``k`` drafts were accepted.

Notation follows Leviathan et al. (2023) and Chen et al. (2023): **p = target, q = draft**.
``q_draft=None`` means a deterministic drafter (n-gram, argmax draft): q is one-hot on the
drafted token, so acceptance becomes ``min(1, p(x))`` and the residual is ``p`` with ``x``
removed.

These functions know nothing about models, caches or tokenizers; they take probabilities or
logits and an explicit ``torch.Generator`` for every random draw, so they are tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localspec.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: keep ``num_accepted`` drafts, then append ``token``."""

    num_accepted: int
    token: int
    is_bonus: bool  # True: all drafts accepted and ``token`` came from p at position k


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """min(1, p(x) / q(x)) for a drafted token x; q=None is a one-hot draft."""
    p_x = float(p[token])
    q_x = 1.0 if q is None else float(q[token])
    if q_x <= 0.0:
        return 1.0 if p_x > 0.0 else 0.0
    return min(1.0, p_x / q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): where the recovered token is drawn after rejecting ``token``.

    p, q: [vocab]. With a one-hot q at ``token`` this is p with ``token`` removed.
    """
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        # Only reachable when p == q, where rejection has probability 0; keep p to stay defined.
        return p
    return residual / total


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """Keep the longest draft prefix that equals the target's argmax, then the target's argmax.

    target_logits: [k + 1, vocab] for the positions after the last kept token and each draft.
    """
    k = len(draft_tokens)
    target_argmax = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    num_accepted = 0
    while num_accepted < k and draft_tokens[num_accepted] == target_argmax[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted, target_argmax[num_accepted], num_accepted == k)


def verify_tree(target_logits: torch.Tensor, draft_tokens: list[int],
                parents: tuple[int, ...]) -> tuple[Verdict, list[int]]:
    """Greedy verification of a draft tree: from the root (the pending token), descend to the
    child that carries the target's argmax at the current row while there is one; the argmax
    at the last row reached is the recovered token (bonus at a leaf). Every row's logits are
    those of its root path fed as a chain, so the kept path is exactly the prefix plain
    greedy decoding would have produced.

    target_logits: [len(draft_tokens) + 1, vocab] for the feed ``[pending, *draft_tokens]``;
    parents[i]: the row of token i's parent in that feed. Returns the verdict and the kept
    path's rows, 0 first.
    """
    target_argmax = target_logits.argmax(dim=-1).tolist()  # [len(draft_tokens) + 1]
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i + 1)
    path = [0]
    while (child := next((c for c in children.get(path[-1], ())
                          if draft_tokens[c - 1] == target_argmax[path[-1]]), None)) is not None:
        path.append(child)
    leaf = path[-1] not in children
    return Verdict(len(path) - 1, target_argmax[path[-1]], leaf), path


def verify_sampling(
    p_target: torch.Tensor,
    q_draft: torch.Tensor | None,
    draft_tokens: list[int],
    generator: torch.Generator,
    refused: tuple[int, torch.Tensor | None] | None = None,
) -> Verdict:
    """Speculative sampling: accept x_i with min(1, p/q), else draw from the residual.

    p_target: [k + 1, vocab] target probabilities (already warped by ``logits_to_probs``).
    q_draft:  [k, vocab] draft probabilities under the same warping, or None (one-hot draft).
    refused:  a draft x_k drawn from q_k (None: one-hot) and cut before the pass because p_k
              (a grammar's masked target) gives it probability 0: its acceptance probability
              is 0, so once the k drafts before it are accepted, the token at row k is the
              residual's norm(max(0, p_k - q_k)), not p_k's. Drawing from p_k there would
              over-weight the tokens q_k also proposes (each was already accepted with
              probability min(q, p) on the path where it was drafted).
    The emitted tokens are distributed exactly as sampling from p one token at a time.
    """
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64,
                          device=generator.device).tolist()
    for i, token in enumerate(draft_tokens):
        q_i = None if q_draft is None else q_draft[i]
        if uniforms[i] < acceptance_probability(p_target[i], q_i, token):
            continue
        residual = residual_distribution(p_target[i], q_i, token)
        return Verdict(i, sample(residual, generator), False)
    if refused is not None:
        token, q_k = refused
        return Verdict(k, sample(residual_distribution(p_target[k], q_k, token), generator),
                       False)
    return Verdict(k, sample(p_target[k], generator), True)
