"""The student MOPD trains: its model, optimizer and train step, and the batches a step is made of.

    Student.load(dir, spec)            the trained copy, its optimizer (`adamw`) and the frozen reference where
                                       the loss needs one: in one process, and on each FSDP2 rank
    Student.train_step(rollouts, ...)  one optimizer step on the teachers' per-token scores
    scheduled_learning_rate            the step's learning rate (`lr_schedule`)
    collate / length_sorted_micro_batches   rollouts → padded tensors, cut by length
    packed_collate / token_micro_batches    `packing`: rollouts → packed rows, cut by real tokens
    token_weights                      each rollout's per-token weight in the step's loss (`balance_tokens`)

`mopd.distill.trainer` drives it step by step; `mopd.distill.sharded` runs the same step under FSDP2.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mopd.base.sft import pack
from mopd.distill.loss import (
    extrapolated_teacher,
    importance_weights,
    masked_weights,
    mopd_loss,
    token_metrics,
    vocab_reverse_kl,
)
from mopd.distill.packing import check_packing, packed_rows
from mopd.distill.scorer import TeacherScores
from mopd.precision import autocast
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded; packed: [R, L] rollouts back to back
    attention_mask: torch.Tensor | None  # [B, L]; packed: None (the position ids mark the boundaries)
    positions: torch.Tensor  # [B, T] index of the logits that predict completion token t (packed: in the flattened rows)
    tokens: torch.Tensor  # [B, T] completion tokens
    mask: torch.Tensor  # [B, T] 1 on tokens the student generated
    rollout_logprobs: torch.Tensor  # [B, T]
    teacher_logprobs: torch.Tensor  # [B, T]
    position_ids: torch.Tensor | None = None  # packed: [R, L], restarting at 0 on each rollout

    def to(self, device) -> Batch:
        return Batch(**{name: None if tensor is None else tensor.to(device) for name, tensor in vars(self).items()})


class Student:
    """The trained copy of the student: model, tokenizer, optimizer, and the MOPD train step."""

    def __init__(self, model, tokenizer, optimizer, spec: DistillSpec, reference=None):
        self.model, self.tokenizer, self.optimizer, self.spec, self.reference = model, tokenizer, optimizer, spec, reference

    @classmethod
    def load(
        cls, model_dir: str | Path, spec: DistillSpec, reference_dir: str | Path, device: str | torch.device = "cpu",
        place: Callable[[torch.nn.Module], object] | None = None,
        restore_optimizer: Callable[[torch.nn.Module, torch.optim.Optimizer, Path], None] | None = None,
    ) -> Student:
        """The trained copy, its AdamW (`adamw`) with the state of `model_dir/optimizer.pt` where there is one,
        the frozen reference on `device` where the loss needs one, and the tokenizer. `place` puts the
        model on its device (default: `.to(device)`; an FSDP2 rank shards it); `restore_optimizer` loads
        the saved state (default: torch's format, onto `device`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import mopd.model  # noqa: F401  (registers the K3 hybrid)

        model_dir, saved = Path(model_dir), Path(model_dir) / "optimizer.pt"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        if place is None:
            model.to(device)
        else:
            place(model)
        optimizer = adamw(model, spec)
        if saved.is_file() and restore_optimizer:
            restore_optimizer(model, optimizer, saved)
        elif saved.is_file():
            optimizer.load_state_dict(torch.load(saved, weights_only=True, map_location=device))
        reference = None
        if spec.scores_a_reference:  # ExOPD measures the teacher's gain against the initial student
            reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval().to(device)
        if spec.packing:
            check_packing(model, "the student")
        return cls(model, AutoTokenizer.from_pretrained(model_dir), optimizer, spec, reference)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    def save(self, path: Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def train_step(self, rollouts: list[Rollout], scores: list[TeacherScores], cells: list[str]) -> dict:
        """One optimizer step over all rollouts, in micro-batches of similar length.

        Every token carries its weight in the step's loss (`token_weights`), so the summed gradients
        of the micro-batches equal those of the whole batch at once (padding every rollout to the
        longest would cost the most compute where rollouts differ most: a sum next to an agent episode).
        With `packing` short rollouts share rows (`mopd.distill.packing`) instead of padding to the longest.
        """
        spec = self.spec
        pad_id = self.model.config.pad_token_id or 0
        full = collate(rollouts, scores, pad_id)  # completion-only tensors, for the metrics
        orm = orm_advantages(rollouts, cells)
        weights = token_weights(rollouts, cells, spec.balance_tokens)
        train_logprobs = torch.zeros_like(full.rollout_logprobs)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for rows in micro_batches(rollouts, spec.micro_batch_tokens, spec.packing):
            batch = micro_batch([rollouts[i] for i in rows], [scores[i] for i in rows], pad_id, spec.packing).to(self.model.device)
            loss, logprobs = self.micro_batch_loss(batch, [scores[i] for i in rows], orm[rows], weights[rows])
            loss.backward()
            loss_sum += float(loss.detach())
            train_logprobs[rows, : logprobs.shape[1]] = logprobs.detach().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.max_grad_norm)
        self.optimizer.step()
        moe = self.model.update_moe_bias() if hasattr(self.model, "update_moe_bias") else {}
        return {"loss": loss_sum, "grad_norm": float(grad_norm), **step_metrics(rollouts, cells, full, train_logprobs, spec),
                **gradient_shares(rollouts, cells, weights), **moe}  # fmt: skip

    def micro_batch_loss(
        self, batch: Batch, scores: list[TeacherScores], orm: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's MOPD loss, the trainer's log-probs [B, T]). `row_weights` [B]: each row's
        per-token weight in the step's loss (`token_weights`); None: the mean over the micro-batch's tokens.
        `precision` bf16: the forwards run under bf16 autocast; log-probs and the loss are fp32 from the logits."""
        spec = self.spec
        weights = None if row_weights is None else batch.mask * row_weights.to(batch.mask.device)[:, None]
        if spec.full_vocab_kl:
            return self.full_vocab_loss(batch, scores, orm, weights)
        with autocast(self.model.device, spec.precision):
            logits = self.completion_logits(self.model, batch)
        train_logprobs = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens[..., None]).squeeze(-1)
        reference = None
        if self.reference is not None:
            with torch.no_grad(), autocast(self.model.device, spec.precision):
                reference_full = torch.log_softmax(self.completion_logits(self.reference, batch).float(), -1)
            reference = reference_full.gather(-1, batch.tokens[..., None]).squeeze(-1)
        loss_args = dict(
            importance=spec.importance.mode, low=spec.importance.low, high=spec.importance.high,
            orm_advantages=orm.to(batch.mask.device), orm_alpha=spec.orm_alpha,
            reference_logprobs=reference, reward_scale=spec.reward_scale, token_weights=weights, rescore=spec.rescore,
        )  # fmt: skip
        return mopd_loss(train_logprobs, batch.rollout_logprobs, batch.teacher_logprobs, batch.mask, **loss_args).loss, train_logprobs

    def full_vocab_loss(
        self, batch: Batch, scores: list[TeacherScores], orm: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`micro_batch_loss` with the exact KL in place of the sampled-token estimate (ExOPD: to the extrapolated
        teacher); the ORM term stays. Only the trained positions (the mask's) reach the vocabulary-wide work, fused
        (`vocab_reverse_kl`); the trainer's log-probs elsewhere are 0."""
        spec = self.spec
        with autocast(self.model.device, spec.precision):
            logits, rows = self.trained_logits(self.model, batch)
        trained = batch.mask.bool()
        teacher = torch.cat([s.full_logprobs[m[: len(s.full_logprobs)]] for s, m in zip(scores, trained, strict=True)])
        teacher = teacher.to(logits.device)
        if self.reference is not None:
            with torch.no_grad(), autocast(self.model.device, spec.precision):
                reference_logits, _ = self.trained_logits(self.reference, batch)
            teacher = extrapolated_teacher(teacher, torch.log_softmax(reference_logits[rows].float(), -1), spec.reward_scale)
        kl, token_logprobs = vocab_reverse_kl(logits, rows, teacher, batch.tokens[trained])
        train_logprobs = torch.zeros_like(batch.mask).masked_scatter(trained, token_logprobs)
        kl_loss = (kl * masked_weights(batch.mask, weights)[trained]).sum()
        outcome_args = dict(
            importance=spec.importance.mode, low=spec.importance.low, high=spec.importance.high,
            orm_advantages=orm.to(batch.mask.device), orm_alpha=spec.orm_alpha, token_weights=weights, rescore=spec.rescore,
        )  # fmt: skip  (a zero KL advantage: the teacher's log-probs are the trainer's)
        outcome_only = mopd_loss(train_logprobs, batch.rollout_logprobs, train_logprobs.detach(), batch.mask, **outcome_args)
        return kl_loss + outcome_only.loss, train_logprobs

    @staticmethod
    def trained_logits(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [M, V], rows [N]): the model's logits over the columns that hold completion positions, flattened,
        and the row of each trained position (the mask's, in order) in them."""
        trained = batch.mask.bool()
        if batch.position_ids is not None:  # packed: the rollouts' positions index the flattened rows
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            return logits.flatten(0, 1), batch.positions[trained]
        first, last = int(batch.positions.min()), int(batch.positions.max())
        keep = torch.arange(first, last + 1, device=batch.input_ids.device)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, logits_to_keep=keep).logits
        row_of = torch.arange(len(keep) * logits.shape[0], device=logits.device).view(logits.shape[0], len(keep))
        return logits.flatten(0, 1), row_of.gather(1, batch.positions - first)[trained]

    @staticmethod
    def completion_logits(model, batch: Batch) -> torch.Tensor:
        """[B, T, V] logits at the positions that predict each rollout's completion tokens."""
        if batch.position_ids is not None:  # packed: the rollouts' positions index the flattened rows
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            return logits.flatten(0, 1)[batch.positions]
        # the head only over the columns that hold a completion position: the prompts' logits are never read
        first, last = int(batch.positions.min()), int(batch.positions.max())
        keep = torch.arange(first, last + 1, device=batch.input_ids.device)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, logits_to_keep=keep).logits
        return logits.gather(1, (batch.positions - first)[..., None].expand(-1, -1, logits.shape[-1]))


def adamw(model: torch.nn.Module, spec: DistillSpec) -> torch.optim.AdamW:
    """The student's optimizer, the same in one process and on every FSDP2 rank."""
    # fused: one kernel over all the tensors (5 ms a step instead of 22-27 ms on CPU). It needs floating-point
    # parameters on a device with fused kernels: the student's are float32 on "cpu" or "cuda" (a recipe's only
    # devices), and FSDP2's DTensor shards qualify too (DTensor runs `_fused_adamw_` pointwise, shard by shard).
    return torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0, fused=True)


def micro_batches(rollouts: list[Rollout], max_tokens: int | None, packing: bool) -> list[list[int]]:
    return token_micro_batches(rollouts, max_tokens) if packing else length_sorted_micro_batches(rollouts, max_tokens)


def micro_batch(rollouts: list[Rollout], scores: list[TeacherScores], pad_id: int, packing: bool) -> Batch:
    return packed_collate(rollouts, scores, pad_id) if packing else collate(rollouts, scores, pad_id)


def collate(rollouts: list[Rollout], scores: list[TeacherScores], pad_id: int) -> Batch:
    width = max(len(r.prompt_ids) + len(r.token_ids) for r in rollouts)
    steps = max(len(r.token_ids) for r in rollouts)
    input_ids = torch.full((len(rollouts), width), pad_id)
    attention_mask = torch.zeros((len(rollouts), width), dtype=torch.long)
    positions = torch.zeros((len(rollouts), steps), dtype=torch.long)
    for i, r in enumerate(rollouts):
        seq = r.prompt_ids + r.token_ids
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = 1
        positions[i] = (len(r.prompt_ids) - 1 + torch.arange(steps)).clamp(max=width - 1)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, positions=positions, **completion_tensors(rollouts, scores, steps))


def packed_collate(rollouts: list[Rollout], scores: list[TeacherScores], pad_id: int = 0) -> Batch:
    """The rollouts back to back in rows (`mopd.distill.packing`); the completion tensors as `collate`'s."""
    input_ids, position_ids, starts = packed_rows([r.prompt_ids + r.token_ids for r in rollouts], pad_id)
    steps = max(len(r.token_ids) for r in rollouts)
    positions = torch.stack([
        (start + len(r.prompt_ids) - 1 + torch.arange(steps)).clamp(max=start + len(r.prompt_ids) + len(r.token_ids) - 1)
        for start, r in zip(starts, rollouts, strict=True)
    ])  # fmt: skip
    return Batch(
        input_ids=input_ids, attention_mask=None, positions=positions, position_ids=position_ids,
        **completion_tensors(rollouts, scores, steps),
    )  # fmt: skip


def completion_tensors(rollouts: list[Rollout], scores: list[TeacherScores], steps: int) -> dict[str, torch.Tensor]:
    """Per rollout, its completion's tokens, loss mask, sampler and teacher log-probs, zero-padded to `steps`."""
    return {
        "tokens": pad_stack([torch.tensor(r.token_ids) for r in rollouts], steps, dtype=torch.long),
        "mask": pad_stack([torch.tensor(r.loss_mask, dtype=torch.float32) for r in rollouts], steps),
        "rollout_logprobs": pad_stack([torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts], steps),
        "teacher_logprobs": pad_stack([s.logprobs.float() for s in scores], steps),
    }


def length_sorted_micro_batches(rollouts: list[Rollout], max_tokens: int | None) -> list[list[int]]:
    """Rollout indices sorted by length, cut into runs whose padded size fits `max_tokens`
    (None: one batch of all)."""
    lengths = [len(r.prompt_ids) + len(r.token_ids) for r in rollouts]
    if max_tokens is None:
        return [list(range(len(rollouts)))]
    order = sorted(range(len(rollouts)), key=lengths.__getitem__)
    return pack(order, [lengths[i] for i in order], max_tokens)


def token_micro_batches(rollouts: list[Rollout], max_tokens: int | None) -> list[list[int]]:
    """Rollout indices in order, cut into runs whose real tokens fit `max_tokens` (a longer rollout is a run of
    its own; None: one run of all): the packed rows of a step."""
    runs: list[list[int]] = []
    tokens = 0
    for i, r in enumerate(rollouts):
        length = len(r.prompt_ids) + len(r.token_ids)
        if not runs or (max_tokens is not None and tokens + length > max_tokens):
            runs.append([])
            tokens = 0
        runs[-1].append(i)
        tokens += length
    return runs


def pad_stack(rows: list[torch.Tensor], length: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros((len(rows), length, *rows[0].shape[1:]), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def token_weights(rollouts: list[Rollout], cells: list[str], balance: bool) -> torch.Tensor:
    """Each rollout's per-token weight in the step's loss [B]; over the step's generated tokens they sum to 1.

    Unbalanced, every token weighs alike (1 / the step's tokens), so a cell's share of the gradient is its
    share of the tokens: long agent episodes outweigh short sums. Balanced (`distill.balance_tokens`), a
    cell's tokens share its share of the step's rollouts: (rollouts of the cell / rollouts) / tokens of the cell.
    """
    tokens = [float(sum(r.loss_mask)) for r in rollouts]
    if not balance:
        return torch.full((len(rollouts),), 1.0 / max(sum(tokens), 1.0))
    rollouts_of, tokens_of = Counter(cells), Counter()
    for cell, n in zip(cells, tokens, strict=True):
        tokens_of[cell] += n
    return torch.tensor([rollouts_of[cell] / len(cells) / max(tokens_of[cell], 1.0) for cell in cells])


def gradient_shares(rollouts: list[Rollout], cells: list[str], weights: torch.Tensor) -> dict[str, float]:
    """`<cell>/gradient_share`: the cell's share of the step's loss weight (of its gradient tokens)."""
    out: dict[str, float] = {}
    for rollout, cell, weight in zip(rollouts, cells, weights.tolist(), strict=True):
        key = f"{cell}/gradient_share"
        out[key] = out.get(key, 0.0) + weight * sum(rollout.loss_mask)
    return out


def orm_advantages(rollouts: list[Rollout], cells: list[str]) -> torch.Tensor:
    """Each verifier reward minus a baseline: the mean reward of its group (the step's samples of the
    same prompt, as in GRPO) where the prompt was sampled more than once, else of its cell in the step."""
    by_cell: dict[str, list[float]] = {}
    by_prompt: dict[tuple, list[float]] = {}
    for r, cell in zip(rollouts, cells, strict=True):
        by_cell.setdefault(cell, []).append(r.reward)
        by_prompt.setdefault((cell, tuple(r.prompt_ids)), []).append(r.reward)

    def baseline(r: Rollout, cell: str) -> float:
        group = by_prompt[(cell, tuple(r.prompt_ids))]
        return statistics.fmean(group if len(group) > 1 else by_cell[cell])

    return torch.tensor([r.reward - baseline(r, cell) for r, cell in zip(rollouts, cells, strict=True)])


def scheduled_learning_rate(spec: DistillSpec, step: int) -> float:
    """The learning rate of step `step` (1-based) of `spec.steps`."""
    if spec.lr_schedule == "constant":
        return spec.learning_rate
    return spec.learning_rate * 0.5 * (1 + math.cos(math.pi * (step - 1) / spec.steps))


# ----------------------------------------------------------------------------- metrics
def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    return {
        "reward": statistics.fmean(r.reward for r in rollouts),
        "thinking_tokens": statistics.fmean(r.thinking_tokens for r in rollouts),
        "answer_tokens": statistics.fmean(r.answer_tokens for r in rollouts),
        "over_budget": statistics.fmean(r.over_budget for r in rollouts),
        "truncated": statistics.fmean(r.truncated for r in rollouts),
    }


def step_metrics(rollouts, cells, full: Batch, train_logprobs: torch.Tensor, spec: DistillSpec) -> dict[str, float]:
    """The step's token, rollout and per-cell metrics from the trainer's log-probs of every rollout."""
    _, out_of_bounds = importance_weights(
        train_logprobs, full.rollout_logprobs, spec.importance.mode, spec.importance.low, spec.importance.high
    )
    return {
        **token_metrics(train_logprobs, full.rollout_logprobs, full.teacher_logprobs, full.mask, out_of_bounds),
        **rollout_metrics(rollouts),
        **per_cell_metrics(rollouts, cells, train_logprobs, full, spec),
    }


def per_cell_metrics(rollouts, cells, train_logprobs, batch: Batch, spec: DistillSpec) -> dict[str, float]:
    """`<cell>/<metric>` for every teacher key in the batch."""
    _, out_of_bounds = importance_weights(
        train_logprobs, batch.rollout_logprobs, spec.importance.mode, spec.importance.low, spec.importance.high
    )
    out: dict[str, float] = {}
    for cell in sorted(set(cells)):
        rows = torch.tensor([i for i, c in enumerate(cells) if c == cell], device=train_logprobs.device)
        tokens = token_metrics(
            train_logprobs[rows], batch.rollout_logprobs[rows], batch.teacher_logprobs[rows], batch.mask[rows], out_of_bounds[rows]
        )
        stats = {**tokens, **rollout_metrics([rollouts[i] for i in rows.tolist()]), "samples": len(rows)}
        out.update({f"{cell}/{name}": value for name, value in stats.items()})
    return out


# ----------------------------------------------------------------------------- checkpoints
