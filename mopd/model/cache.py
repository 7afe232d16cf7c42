"""Generation cache for the hybrid: a constant-size KDA state per linear layer, the MLA latent per full layer.

A transformers `Cache`, so `generate()` can carry it. MLA layers reuse transformers' `DynamicLayer`
with the normed latent c_kv as "keys" and the shared k_r as "values": each token adds exactly
`kv_lora_rank + qk_rope_head_dim` numbers per MLA layer. KDA layers hold the `KDAState` the attention
returned last (conv tail + recurrent state), whose size does not depend on the sequence length.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicLayer

from mopd.model.config import K3HybridConfig
from mopd.model.kda import KDAState


class KDAStateLayer:
    """One KDA layer's slot in the cache. Beam search and batch edits map over the state's tensors."""

    is_compileable = False
    supports_early_init = False
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        self.state: KDAState | None = None

    def reset(self) -> None:
        self.state = None

    def map_state(self, fn) -> None:
        if self.state is not None:
            self.state = KDAState(
                **{f.name: fn(getattr(self.state, f.name)) for f in dataclasses.fields(self.state)}
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map_state(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a KDA state cannot be rolled back to an earlier token")

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(getattr(self.state, f.name).nbytes for f in dataclasses.fields(self.state))


class K3HybridCache(Cache):
    def __init__(self, config: K3HybridConfig):
        layers = [
            KDAStateLayer() if config.is_kda_layer(i) else DynamicLayer()
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    def kda_state(self, layer_idx: int) -> KDAState | None:
        return self.layers[layer_idx].state

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        self.layers[layer_idx].state = state

    def kda_state_bytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, KDAStateLayer))

    def mla_cache_numel(self) -> int:
        """Numbers held for MLA layers (latent + shared k_r), summed over layers and batch."""
        return sum(
            layer.keys.numel() + layer.values.numel()
            for layer in self.layers
            if isinstance(layer, DynamicLayer) and layer.is_initialized
        )
