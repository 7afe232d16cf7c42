"""Auxiliary-loss-free expert balancing: two rules that move the router's selection bias.

The bias `b` (upstream `e_score_correction_bias`) only chooses the experts: top-k of `s + b`, while
the combine weights use the unbiased scores `s`. Trainers call the update once per optimizer step
with what the router saw during that step.
"""

from __future__ import annotations

import torch


def sign_bias_update(load: torch.Tensor, bias: torch.Tensor, speed: float) -> torch.Tensor:
    """DeepSeek-V3: push each expert's bias by `speed` toward the mean load, then re-centre."""
    step = speed * torch.sign(load.float().mean() - load.float())
    return bias + (step - step.mean())


def quantile_bias_update(scores: torch.Tensor, bias: torch.Tensor, top_k: int, rate: float) -> torch.Tensor:
    """K3 quantile balancing (Su, kexue.fm/archives/11619): set the bias so each expert would win ~kT/n tokens.

    `scores` [T, n] are the unbiased router scores of one step. A token picks expert j when its biased
    score beats the token's (k+1)-th best biased score, i.e. when the margin m_ij > 0. Shifting
    b_j by the (q+1)-th largest margin of column j leaves exactly q = round(kT/n) tokens above it.
    """
    num_tokens, num_experts = scores.shape
    if top_k >= num_experts or num_tokens == 0:
        return bias
    biased = scores.float() + bias.float()
    threshold = biased.topk(top_k + 1, dim=-1).values[:, -1:]
    margins = biased - threshold
    target = min(round(top_k * num_tokens / num_experts), num_tokens - 1)
    cutoff = margins.topk(target + 1, dim=0).values[-1]
    return bias - rate * cutoff


def max_over_mean(load: torch.Tensor) -> float:
    """Expert load imbalance: 1.0 is perfectly balanced, n_experts/top_k is total collapse."""
    load = load.float()
    return float(load.max() / load.mean().clamp_min(1e-9))
