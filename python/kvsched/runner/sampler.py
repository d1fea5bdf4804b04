"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds.

Every row is processed by the same tensor ops; the only per-request Python work is one noise draw per *seeded*
request (its own ``torch.Generator``), so a seeded request's tokens depend on its seed alone, not on what else
is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_top_k_top_p", "sample"]

_GREEDY_EPS = 1e-5


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p (nucleus) sets.

    ``top_k``: int64 ``[n]``, 0 = off; ``top_p``: float32 ``[n]``, 1.0 = off. The top-p set is the smallest
    set of the most likely tokens whose probability reaches ``top_p``; it always keeps at least one token.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """One token per row of float32 ``logits`` ``[n, vocab]``; returns int64 ``[n]`` on the logits' device.

    ``temperature`` float32 ``[n]`` (0 = greedy). ``generators``: one entry per row; a row with a generator
    draws its noise from it, the others from the global generator.
    """
    greedy_tokens = logits.argmax(dim=-1)
    greedy = temperature < _GREEDY_EPS
    if bool(greedy.all()):
        return greedy_tokens
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = apply_top_k_top_p(logits / temp.unsqueeze(1), top_k, top_p)
    probs = scaled.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a cumulative-sum search.
    noise = torch.empty_like(probs).exponential_()
    if generators is not None:
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)
