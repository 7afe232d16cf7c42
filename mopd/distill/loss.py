"""The MOPD loss: sampled-token reverse KL as a dense per-token advantage, trained REINFORCE-style.

For a token y_t the student sampled, its teacher's advantage is

    A_t = sg[ log πT(y_t | y<t) − log πθ(y_t | y<t) ]            (MiMo-V2-Flash, DeepSeek-V4, NeMo-RL)

with log πθ the trainer's own recomputed log-prob. The surrogate −Σ_t w_t·A_t·log πθ(y_t) has, in
expectation over y ~ πθ, the gradient of KL(πθ ‖ πT). w_t corrects the gap between the rollout
engine's sampler and the trainer: IcePop zeroes tokens whose ratio πθ/π_rollout leaves [low, high];
TIS truncates the ratio at `high`.

Options: an outcome term α·A_ORM from the verifiers, ExOPD reward scaling λ (with a reference
policy, A = λ·(log πT − log πref) − (log πθ − log πref)), and the exact full-vocabulary reverse KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def reverse_kl_advantage(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor | None = None,
    reward_scale: float = 1.0,
) -> torch.Tensor:
    """Per-token A_t, detached. With λ ≠ 1 the teacher's log-ratio to a reference is scaled (ExOPD)."""
    student = student_logprobs.detach()
    if reward_scale == 1.0:
        return teacher_logprobs - student
    if reference_logprobs is None:
        raise ValueError("reward_scale != 1 (ExOPD) needs reference_logprobs")
    return reward_scale * (teacher_logprobs - reference_logprobs) - (student - reference_logprobs)


def importance_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mode: str, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, out_of_bounds) for the train/rollout ratio r = πθ / π_rollout per token."""
    ratio = torch.exp(train_logprobs.detach() - rollout_logprobs)
    out_of_bounds = (ratio < low) | (ratio > high)
    if mode == "icepop":
        return (~out_of_bounds).to(ratio.dtype), out_of_bounds
    if mode == "tis":
        return ratio.clamp(max=high), out_of_bounds
    if mode == "none":
        return torch.ones_like(ratio), out_of_bounds
    raise ValueError(f"unknown importance mode {mode!r}; use icepop, tis or none")


def mopd_loss(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance: str = "icepop",
    low: float = 0.5,
    high: float = 5.0,
    orm_advantages: torch.Tensor | None = None,
    orm_alpha: float = 0.0,
    reference_logprobs: torch.Tensor | None = None,
    reward_scale: float = 1.0,
    token_weights: torch.Tensor | None = None,
    rescore: bool = True,
) -> LossOutput:
    """REINFORCE on the reverse-KL advantage; all tensors [B, T] over completion tokens.

    `mask` is 1 on tokens the student generated (observation and padding tokens are 0);
    `orm_advantages` is one value per sequence [B] (e.g. group-normalised verifier rewards);
    `token_weights` [B, T] is each token's weight in the loss (None: the mean over `mask`);
    `rescore` False forms the advantage from the sampler's log-probs instead of the trainer's.
    """
    mask = mask.to(train_logprobs.dtype)
    advantage_student = train_logprobs if rescore else rollout_logprobs
    advantage = reverse_kl_advantage(teacher_logprobs, advantage_student, reference_logprobs, reward_scale)
    if orm_advantages is not None and orm_alpha:
        advantage = advantage + orm_alpha * orm_advantages[:, None]
    weights, out_of_bounds = importance_weights(train_logprobs, rollout_logprobs, importance, low, high)
    loss = -(weights * advantage * train_logprobs * masked_weights(mask, token_weights)).sum()
    return LossOutput(loss=loss, metrics=token_metrics(train_logprobs, rollout_logprobs, teacher_logprobs, mask, out_of_bounds))


def masked_weights(mask: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """Each token's weight in a loss: the given weights on masked tokens, or 1/(masked tokens) each."""
    return mask / mask.sum().clamp(min=1) if token_weights is None else token_weights * mask


def token_metrics(train, rollout, teacher, mask, out_of_bounds) -> dict[str, float]:
    n = mask.sum().clamp(min=1)
    return {
        "reverse_kl": float(((train.detach() - teacher) * mask).sum() / n),
        "is_out_of_bounds": float((out_of_bounds * mask).sum() / n),
        "train_rollout_gap": float(((train.detach() - rollout).abs() * mask).sum() / n),
        "tokens": float(n),
    }


def extrapolated_teacher(teacher_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, reward_scale: float) -> torch.Tensor:
    """ExOPD's target over the vocabulary, log of πT^λ · π_ref^(1−λ) renormalised: its log-ratio to the
    reference is λ times the teacher's, as the sampled-token advantage λ(log πT − log π_ref) − (log πθ − log π_ref)
    has it (up to the normaliser)."""
    mixed = reward_scale * teacher_logprobs.float() + (1 - reward_scale) * reference_logprobs.float()
    return torch.log_softmax(mixed, dim=-1)


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per position, KL(student ‖ teacher) = Σ_v πθ(v)·(log πθ(v) − log πT(v)) over the vocabulary."""
    return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)


def full_vocab_reverse_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, token_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact `reverse_kl` per position, averaged over masked positions (or weighted by `token_weights`).
    Differentiable in the student's logits; computed by `vocab_reverse_kl` (fused, a few positions at a time)."""
    vocab = student_logits.shape[-1]
    flat = student_logits.reshape(-1, vocab)
    rows = torch.arange(flat.shape[0], device=flat.device)
    kl, _ = vocab_reverse_kl(flat, rows, teacher_logits.reshape(-1, vocab), torch.zeros_like(rows))
    return (kl.reshape(mask.shape) * masked_weights(mask.to(kl.dtype), token_weights)).sum()


def vocab_reverse_kl(
    logits: torch.Tensor, rows: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(πθ ‖ πT) [N], log πθ(token) [N]) at the N positions `rows` of `logits` [M, V], against the teacher's
    `teacher_logits` [N, V] (normalised here) and the sampled `tokens` [N]; in fp32 for logits of any lower dtype.

    The numbers of `reverse_kl(log_softmax(z.float()), log_softmax(t.float()))` and `log_softmax(z).gather(token)`,
    but each vocabulary-wide pass runs over `KL_ROWS` positions at a time while they are in cache, and the KL's
    backward is its closed form ∂KL/∂z = πθ ⊙ (log πθ − log πT − KL), kept from the forward (rounded to the
    logits' dtype once, at the end, as autograd rounds it). Against whole-tensor passes over SmolLM2's 49k
    vocabulary: `benchmarks/distill_items.py --items fused`. `rows` must be distinct."""
    return _VocabReverseKL.apply(logits, rows, teacher_logits, tokens)


KL_ROWS = 32  # positions per fused chunk: 32 × 49,152 fp32 values (6 MiB) a tensor, which a CPU's L2/L3 holds


class _VocabReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, teacher_logits, tokens):
        n, exact = rows.shape[0], torch.promote_types(logits.dtype, torch.float32)
        kl = torch.empty(n, dtype=exact, device=logits.device)
        token_logprobs, lse = torch.empty_like(kl), torch.empty_like(kl)
        grad = logits.new_empty((n, logits.shape[-1]), dtype=exact) if logits.requires_grad else None  # ∂KL/∂z at the rows
        for chunk in chunks(n):
            z = logits[rows[chunk]].to(exact)
            lse[chunk] = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse[chunk, None])
            token_logprobs[chunk] = logp.gather(-1, tokens[chunk, None]).squeeze(-1)
            gap = logp - torch.log_softmax(teacher_logits[chunk].to(exact), dim=-1)
            p = logp.exp_()
            kl[chunk] = (p * gap).sum(-1)
            if grad is not None:
                grad[chunk] = p.mul_(gap.sub_(kl[chunk, None]))
        ctx.save_for_backward(grad, logits, rows, tokens, lse)
        return kl, token_logprobs

    @staticmethod
    def backward(ctx, grad_kl, grad_token_logprobs):
        grad, logits, rows, tokens, lse = ctx.saved_tensors
        out = torch.zeros_like(logits)
        for chunk in chunks(rows.shape[0]):
            g = grad[chunk] * (0.0 if grad_kl is None else grad_kl[chunk, None])
            if grad_token_logprobs is not None:  # ∂ log πθ(token)/∂z = onehot(token) − πθ
                weight = grad_token_logprobs[chunk, None]
                g -= (logits[rows[chunk]].to(lse.dtype) - lse[chunk, None]).exp_() * weight
                g.scatter_add_(-1, tokens[chunk, None], weight)
            out[rows[chunk]] = g.to(out.dtype)
        return out, None, None, None


def chunks(n: int) -> list[slice]:
    return [slice(start, start + KL_ROWS) for start in range(0, n, KL_ROWS)]
