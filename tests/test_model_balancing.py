"""Aux-loss-free expert balancing on a synthetic router whose scores favour a few experts."""

import torch

from mopd.model import preset_config
from mopd.model.balancing import max_over_mean, quantile_bias_update
from mopd.model.moe import Router

NUM_TOKENS = 2048


def skewed_router(balance: str) -> Router:
    """Router logits = a per-expert preference (+2 ... -2, read from a constant input feature) + token noise."""
    config = preset_config("tiny", moe_balance=balance)
    torch.manual_seed(0)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(0.1 * torch.randn_like(router.weight))
        router.weight[:, 0] = torch.linspace(2.0, -2.0, config.num_experts)
    return router


def token_batch(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(NUM_TOKENS, preset_config("tiny").hidden_size, generator=generator)
    tokens[:, 0] = 1.0
    return tokens


def load_of(router: Router, tokens: torch.Tensor) -> torch.Tensor:
    router.eval()
    _, indices = router(tokens, None)
    return torch.bincount(indices.flatten(), minlength=router.weight.shape[0])


def train_bias(router: Router, steps: int) -> None:
    router.train()
    for step in range(steps):
        router(token_batch(seed=100 + step), None)
        router.update_bias(rate=1.0, speed=0.01)


def test_quantile_balancing_flattens_a_skewed_router():
    router = skewed_router("quantile")
    held_out = token_batch(seed=1)
    before = max_over_mean(load_of(router, held_out))
    assert before >= 2.0, f"the synthetic router should be skewed, max/mean={before:.2f}"

    train_bias(router, steps=3)

    after = max_over_mean(load_of(router, held_out))
    assert after <= 1.3, f"max/mean after quantile balancing: {after:.2f} (before {before:.2f})"


def test_sign_rule_reduces_imbalance():
    router = skewed_router("sign")
    held_out = token_batch(seed=1)
    before = max_over_mean(load_of(router, held_out))

    train_bias(router, steps=50)

    after = max_over_mean(load_of(router, held_out))
    assert after < 0.6 * before, f"sign rule: max/mean {before:.2f} -> {after:.2f}"
    assert abs(float(router.e_score_correction_bias.mean())) < 1e-5, "the sign rule keeps the bias centred"


def test_repeated_quantile_updates_on_one_batch_reach_the_target_load():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(1000, 8, generator=generator) * torch.linspace(1.0, 0.2, 8)
    bias = torch.zeros(8)
    for _ in range(10):
        bias = quantile_bias_update(scores, bias, top_k=2, rate=1.0)
    load = torch.bincount((scores + bias).topk(2, dim=-1).indices.flatten(), minlength=8)
    target = 2 * 1000 / 8
    assert (load - target).abs().max() <= 0.05 * target, load.tolist()


def test_bias_chooses_experts_but_does_not_weight_them():
    router = skewed_router("quantile")
    tokens = token_batch(seed=2)
    router.eval()
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-1.0, 1.0, router.weight.shape[0]))
    weights, indices = router(tokens, None)
    scores = torch.sigmoid(tokens @ router.weight.T)
    expected = scores.gather(1, indices)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected)
    biased_top = (scores + router.e_score_correction_bias).topk(router.top_k, dim=-1).indices
    assert torch.equal(indices.sort(-1).values, biased_top.sort(-1).values)
