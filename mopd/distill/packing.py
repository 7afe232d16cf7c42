"""Packed rows: variable-length sequences back to back in rows, so short sequences share a row instead of padding.

    packed_rows(sequences)         rows as wide as the longest sequence, filled longest first; position ids restart at
                                   0 on each sequence (and on the padding at a row's end)
    check_packing(model, name)     PackingError unless `model` keeps packed sequences apart

Rows are no wider than the longest sequence: a padded batch's width. One row of everything would compute no
padding at all, but its attention is quadratic in the whole row (a block-diagonal mask still computes every
pair): SmolLM2-135M's 8 rollouts of ~140 tokens in one 1,113-token row trained 0.75x as fast as padded
(docs/experiments.md, 2026-12-07). At the longest's width, packing computes at most what padding does.

A model keeps them apart when its attention reads the segment boundaries from the restarting position
ids: transformers' llama-style models do under sdpa and eager (`masking_utils` turns them into a
block-diagonal causal mask when no attention mask is given) and under FlashAttention (varlen). The K3
hybrid does not: its KDA layers carry a recurrent state and short-convolution inputs from one token to
the next, and its forward takes no position ids, so a sequence would read its predecessor's state.
"""

from __future__ import annotations

import itertools

import torch

from mopd.recipe import RecipeError


class PackingError(RecipeError):
    """`distill.packing` asked of a model that does not keep packed sequences apart."""


def packed_rows(
    sequences: list[list[int]], pad_id: int = 0, width: int | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input ids [R, W], position ids [R, W], where each sequence starts in the flattened [R * W]): the sequences
    first-fit, longest first, into rows of `width` tokens (default: the longest sequence's)."""
    width = width or max(len(s) for s in sequences)
    rows: list[list[int]] = []  # sequence indices per row
    free: list[int] = []
    for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        row = next((r for r, room in enumerate(free) if room >= len(sequences[i])), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= len(sequences[i])
    input_ids = torch.full((len(rows), width), pad_id)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    starts = [0] * len(sequences)
    for r, members in enumerate(rows):
        lengths = [len(sequences[i]) for i in members] + [free[r]]  # the padding at the end is a segment of its own
        offsets = [0, *itertools.accumulate(lengths)]
        for i, offset in zip(members, offsets, strict=False):
            input_ids[r, offset : offset + len(sequences[i])] = torch.tensor(sequences[i])
            starts[i] = r * width + offset
        position_ids[r] = torch.cat([torch.arange(n) for n in lengths])
    return input_ids.to(device), position_ids.to(device), starts


@torch.no_grad()
def keeps_packed_sequences_apart(model: torch.nn.Module) -> bool:
    """Whether a sequence packed after another gets the logits it gets alone."""
    vocab = model.get_output_embeddings().weight.shape[0]
    first, second = [(7 * i + 3) % vocab for i in range(6)], [(5 * i + 11) % vocab for i in range(4)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        alone = model(input_ids=torch.tensor([second], device=device), use_cache=False).logits
        input_ids, position_ids, starts = packed_rows([first, second], width=len(first) + len(second), device=device)
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[:, starts[1] :]
    finally:
        model.train(was_training)
    return torch.allclose(packed.float(), alone.float(), rtol=1e-4, atol=1e-4)


def check_packing(model: torch.nn.Module, name: str) -> None:
    if not keeps_packed_sequences_apart(model):
        raise PackingError(
            f"distill.packing: {name} ({type(model).__name__}) does not keep packed sequences apart (a sequence "
            "packed after another gets other logits than alone: recurrent state such as the K3 hybrid's KDA, or an "
            "attention that ignores position ids); use packing: false"
        )
