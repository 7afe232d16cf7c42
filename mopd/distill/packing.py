"""Packed rows: variable-length sequences back to back in one row, so no padding token is computed.

    packed_row(sequences)          input ids [1, N] and position ids [1, N] that restart at 0 on each sequence
    check_packing(model, name)     PackingError unless `model` keeps packed sequences apart

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


def packed_row(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input ids [1, N], position ids [1, N], each sequence's first column) of the sequences back to back."""
    starts = [0, *itertools.accumulate(len(s) for s in sequences)][:-1]
    input_ids = torch.tensor([[token for s in sequences for token in s]], device=device)
    position_ids = torch.cat([torch.arange(len(s), device=device) for s in sequences])[None]
    return input_ids, position_ids, starts


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
        input_ids, position_ids, starts = packed_row([first, second], device)
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
