"""MOPD loss: its gradient is the reverse-KL gradient; it vanishes at the teacher; IcePop masks exactly."""

import math

import pytest
import torch

from mopd.distill import loss as loss_module
from mopd.distill.loss import (
    extrapolated_teacher,
    full_vocab_reverse_kl,
    importance_weights,
    mopd_loss,
    reverse_kl_advantage,
    vocab_reverse_kl,
)

V = 7


def toy_policies(seed=0):
    gen = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_()
    teacher_logprobs = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), -1)
    return student_logits, teacher_logprobs


def analytic_reverse_kl_grad(student_logits, teacher_logprobs):
    logp = torch.log_softmax(student_logits.detach(), -1)
    p = logp.exp()
    kl = (p * (logp - teacher_logprobs)).sum()
    return p * (logp - teacher_logprobs - kl)


def test_expected_gradient_equals_analytic_reverse_kl_gradient():
    student_logits, teacher = toy_policies()
    logp = torch.log_softmax(student_logits, -1)
    tokens = torch.arange(V)
    # Every token as a one-token sequence, weighted by its probability: the exact expectation.
    train = logp[tokens][:, None]
    weight = logp.detach().exp()[:, None]
    out = mopd_loss(train, train.detach(), teacher[tokens][:, None], weight, importance="none")
    (grad,) = torch.autograd.grad(out.loss, student_logits)
    torch.testing.assert_close(grad, analytic_reverse_kl_grad(student_logits, teacher), atol=1e-12, rtol=0)


def test_sampled_gradient_converges_to_reverse_kl_gradient():
    student_logits, teacher = toy_policies(seed=1)
    logp = torch.log_softmax(student_logits, -1)
    samples = torch.multinomial(logp.detach().exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(2))
    train = logp[samples][:, None]
    out = mopd_loss(train, train.detach(), teacher[samples][:, None], torch.ones_like(train))
    (grad,) = torch.autograd.grad(out.loss, student_logits)
    expected = analytic_reverse_kl_grad(student_logits, teacher)
    assert torch.allclose(grad, expected, atol=0.01), (grad, expected)
    true_kl = float((logp.detach().exp() * (logp.detach() - teacher)).sum())
    assert out.metrics["reverse_kl"] == pytest.approx(true_kl, abs=0.02)


def test_advantage_and_gradient_vanish_when_student_is_the_teacher():
    student_logits, _ = toy_policies()
    logp = torch.log_softmax(student_logits, -1)
    tokens = torch.tensor([[0, 3, 5, 1]])
    train = logp[tokens]
    teacher = train.detach().clone()
    assert torch.equal(reverse_kl_advantage(teacher, train), torch.zeros_like(teacher))
    out = mopd_loss(train, teacher, teacher, torch.ones_like(train))
    (grad,) = torch.autograd.grad(out.loss, student_logits)
    assert torch.count_nonzero(grad) == 0 and out.metrics["reverse_kl"] == 0


def test_icepop_masks_exactly_the_tokens_outside_the_bounds():
    ratios = torch.tensor([[0.3, 0.5, 1.0, 4.9, 5.0, 5.1, 20.0]])
    train = torch.full_like(ratios, -1.0)
    rollout = train - ratios.log()
    weights, oob = importance_weights(train, rollout, "icepop", low=0.5, high=5.0)
    expected_oob = torch.tensor([[True, False, False, False, False, True, True]])
    # exp/log round-off can move a ratio that sits exactly on a bound; those two are checked apart
    inside = ~torch.isclose(ratios, torch.tensor([0.5])) & ~torch.isclose(ratios, torch.tensor([5.0]))
    assert torch.equal(oob[inside], expected_oob[inside])
    assert torch.equal(weights, (~oob).float())


def test_icepop_masked_tokens_get_no_gradient_and_are_reported():
    train = torch.full((2, 2), math.log(0.25), requires_grad=True)  # log-probs as leaves: one grad per token
    rollout = train.detach() + torch.tensor([[0.0, math.log(10)], [0.0, 0.0]])  # token (0, 1): ratio 0.1
    out = mopd_loss(train, rollout, torch.zeros(2, 2), torch.ones(2, 2), importance="icepop", low=0.5, high=5.0)
    (grad,) = torch.autograd.grad(out.loss, train)
    assert grad[0, 1] == 0 and torch.count_nonzero(grad) == 3
    assert out.metrics["is_out_of_bounds"] == pytest.approx(0.25)
    assert out.metrics["train_rollout_gap"] == pytest.approx(math.log(10) / 4)


def test_tis_truncates_ratios_at_the_upper_bound():
    ratios = torch.tensor([[0.2, 1.0, 3.0, 8.0]])
    train = torch.zeros_like(ratios)
    weights, _ = importance_weights(train, -ratios.log(), "tis", low=0.5, high=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.2, 1.0, 2.0, 2.0]]))


def test_exopd_over_the_vocabulary_scales_the_teachers_log_ratio_to_the_reference():
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(2, 3, 7), -1)
    reference, student = (torch.log_softmax(torch.randn(2, 3, 7), -1) for _ in range(2))
    torch.testing.assert_close(extrapolated_teacher(teacher, reference, 1.0), teacher)  # λ = 1: the teacher
    target = extrapolated_teacher(teacher, reference, 2.0)
    torch.testing.assert_close(target.exp().sum(-1), torch.ones(2, 3))
    # per token, log target − log πθ is the sampled-token ExOPD advantage minus one normaliser per position
    advantage = reverse_kl_advantage(teacher, student, reference, reward_scale=2.0)
    offset = advantage - (target - student)
    torch.testing.assert_close(offset, offset[..., :1].expand_as(offset))


def test_exopd_scaling_and_orm_term():
    teacher, student, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.tensor([[-3.0]])
    assert reverse_kl_advantage(teacher, student, ref, reward_scale=1.0).item() == pytest.approx(1.0)
    assert reverse_kl_advantage(teacher, student, ref, reward_scale=2.0).item() == pytest.approx(2 * 2 - 1)
    with pytest.raises(ValueError, match="reference_logprobs"):
        reverse_kl_advantage(teacher, student, None, reward_scale=2.0)
    logit = torch.zeros(1, requires_grad=True)
    train = (logit - 1.0)[None, :]
    out = mopd_loss(train, train.detach(), train.detach(), torch.ones_like(train),
                    orm_advantages=torch.tensor([0.5]), orm_alpha=2.0)
    (grad,) = torch.autograd.grad(out.loss, logit)
    assert grad.item() == pytest.approx(-1.0)  # −(α·A_ORM) with A_kl = 0


def test_full_vocab_reverse_kl_is_exact_and_zero_at_the_teacher():
    student_logits, teacher = toy_policies()
    logp = torch.log_softmax(student_logits, -1)
    kl = full_vocab_reverse_kl(student_logits[None, None], teacher[None, None], torch.ones(1, 1))
    assert kl.item() == pytest.approx(float((logp.exp() * (logp - teacher)).sum().detach()), abs=1e-6)
    (grad,) = torch.autograd.grad(kl, student_logits)
    torch.testing.assert_close(grad, analytic_reverse_kl_grad(student_logits, teacher), atol=1e-6, rtol=0)
    same = full_vocab_reverse_kl(teacher[None, None], teacher[None, None], torch.ones(1, 1))
    assert same.item() == pytest.approx(0.0, abs=1e-7)


def unfused_reverse_kl(logits, rows, teacher, tokens):
    """`vocab_reverse_kl` as whole-tensor autograd ops: the reference it must equal."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits[rows].to(exact), -1)
    kl = (logp.exp() * (logp - torch.log_softmax(teacher.to(exact), -1))).sum(-1)
    return kl, logp.gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_fused_vocabulary_kl_and_token_logprobs_equal_the_unfused_ones_and_their_gradients(dtype, monkeypatch):
    """Rows chosen out of order, some logits rows untouched, more positions than one chunk; both outputs weighted
    in the loss, so the backward of each is checked. The tolerance is the dtype's own (the same math, summed in
    another order)."""
    monkeypatch.setattr(loss_module, "KL_ROWS", 4)
    torch.manual_seed(0)
    logits = (3 * torch.randn(12, 50, dtype=torch.float64)).to(dtype).requires_grad_()
    rows = torch.tensor([7, 0, 3, 11, 5, 2, 9, 1, 4])
    teacher, tokens = 3 * torch.randn(9, 50, dtype=torch.float64), torch.randint(0, 50, (9,))
    kl_weights, token_weights = torch.rand(9, dtype=torch.float64), torch.rand(9, dtype=torch.float64)
    outputs = {}
    for name, fn in {"fused": vocab_reverse_kl, "unfused": unfused_reverse_kl}.items():
        kl, token_logprobs = fn(logits, rows, teacher, tokens)
        (grad,) = torch.autograd.grad((kl * kl_weights).sum() + (token_logprobs * token_weights).sum(), logits)
        outputs[name] = (kl, token_logprobs, grad)
    tolerance = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {}
    for fused, unfused in zip(outputs["fused"], outputs["unfused"], strict=True):
        torch.testing.assert_close(fused.to(unfused.dtype), unfused, **tolerance)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[rows] = False
    assert (outputs["fused"][2][untouched] == 0).all()


def test_the_fused_vocabulary_kl_passes_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    rows, teacher, tokens = torch.tensor([4, 1, 2]), torch.randn(3, 7, dtype=torch.float64), torch.tensor([0, 6, 3])
    assert torch.autograd.gradcheck(lambda z: vocab_reverse_kl(z, rows, teacher, tokens), (logits,))
