"""The K3 hybrid for vLLM: the transformers model (`mopd.model`) with its two attention kinds moved
onto vLLM's caches.

Everything that is per token (embedding, Block AttnRes, norms, dense MLP, LatentMoE, lm_head) is the
HF model's own module, run on vLLM's flat token batch [N, D]. Only attention differs:

- MLA ("MHA mode"): the HF layer's query / latent / expansion, then per-head K and V go through
  vLLM's standard `Attention` layer (paged KV cache, any mix of prefills and decodes).
- KDA: the HF layer's projections, gate and short convolutions, and the `mopd.model.kda` ops, with
  the conv tail and recurrent state of each request read from and written back to vLLM's
  Mamba-style state cache by the request's state index.

All parameters are plain `nn.Parameter`s owned here (no vLLM layer repacks them), so
`load_weights` works at any time: that is how rollout weights are updated without a restart.

The model runs in the dtype vLLM picks (fp32, bf16 — vLLM's default for an fp32
checkpoint — or fp16) with the HF model's own casts: the KDA recurrent state and the MoE router bias
stay fp32 and the per-token fp32 computations (gates, norms, router, AttnRes) are the HF layers'.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from mopd.model.config import K3HybridConfig
from mopd.model.kda import KimiDeltaAttention, kda_gate, kda_ops, l2norm
from mopd.model.mla import MLAAttention
from mopd.model.modeling import K3DecoderLayer, K3HybridModel
from mopd.model.mx import unpack_mxfp4_weights


class K3HybridForVLLM(nn.Module, HasInnerState, IsHybrid):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: K3HybridConfig = vllm_config.model_config.hf_config
        self.config = config
        self.model = K3HybridModel(config)  # embedding, final AttnRes and norm, forward loop: reused as is
        self.model.layers = nn.ModuleList(
            VllmDecoderLayer(config, i, vllm_config, prefix=maybe_prefix(prefix, f"model.layers.{i}"))
            for i in range(config.num_hidden_layers)
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Flat batch of N tokens (all requests, decodes first) -> final hidden states [N, D]."""
        out = self.model(input_ids=None if inputs_embeds is not None else input_ids, inputs_embeds=inputs_embeds, use_cache=False)
        return out.last_hidden_state

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters and buffers; works after start too."""
        targets = dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers())  # a tied head keeps its name
        loaded = set()
        ignored = [re.compile(p) for p in K3HybridModel._keys_to_ignore_on_load_unexpected]
        for name, tensor in unpack_mxfp4_weights(weights):  # a packed checkpoint: dequantized at load on CPU
            if any(p.search(name) for p in ignored):
                continue  # stored upstream but unused (e.g. layer 0's attention AttnRes: one source)
            if name not in targets:
                raise KeyError(f"K3 hybrid checkpoint tensor {name!r} has no parameter in the vLLM model")
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        for module in self.modules():
            if hasattr(module, "pack_for_inference"):
                module.pack_for_inference()  # the engine never trains: weights change only here
        # vLLM's Attention keeps its own (unused, fp32-cache) scale parameters; they are not checkpoint weights.
        return loaded | {name for name, _ in self.named_parameters() if ".attn." in name}

    # ----- hybrid state cache: one (conv tail, recurrent state) pair per KDA layer and request -----
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return kda_state_shape(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return kda_state_dtype(vllm_config.model_config, vllm_config.cache_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()


def kda_state_shape(config: K3HybridConfig):
    lac = config.linear_attn_config
    return MambaStateShapeCalculator.kda_state_shape(
        1, lac["num_heads"], lac["head_dim"], conv_kernel_size=lac["short_conv_kernel_size"]
    )


def kda_state_dtype(model_config: ModelConfig, cache_config: CacheConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv tail, recurrent state): the conv tail holds inputs, in the model dtype as in the HF
    cache; the recurrent state is fp32 by default (`--mamba-ssm-cache-dtype`), as the HF layer and
    fla keep it, since rounding it every step would compound over the whole sequence."""
    return MambaStateDtypeCalculator.kda_state_dtype(
        model_config.dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype
    )


class VllmDecoderLayer(K3DecoderLayer):
    """The HF decoder layer (AttnRes, norms, MLP/MoE) with a vLLM-cached attention."""

    def __init__(self, config: K3HybridConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        attention = VllmKDA if self.is_kda else VllmMLA
        self.self_attn = attention(config, layer_idx, vllm_config, prefix=f"{prefix}.self_attn")

    def attend(self, h: torch.Tensor, attention_mask=None, cache=None) -> torch.Tensor:
        return self.self_attn(h)


class VllmMLA(MLAAttention):
    """Gated MLA in MHA mode: per-head K/V materialised from the latent, attention by vLLM."""

    def __init__(self, config: K3HybridConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        if not config.mla_use_nope:
            raise ValueError("the vLLM plugin implements NoPE MLA only (config.mla_use_nope=True)")
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=config.qk_head_dim,
            scale=self.scaling,
            num_kv_heads=self.num_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
            head_size_v=self.v_head_dim,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.unsqueeze(0)  # the HF helpers take [B,T,D]; vLLM's batch is one flat row
        query = self.project_query(x)[0].transpose(0, 1)  # [N,H,qk]
        key, value = (t[0].transpose(0, 1) for t in self.expand_kv(*self.compress_kv(x)))
        out = self.attn(query.contiguous(), key.contiguous(), value.contiguous())
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out)


class VllmKDA(KimiDeltaAttention, MambaBase):
    """KDA whose per-request state lives in vLLM's hybrid state cache (mamba type GDN: same metadata)."""

    def __init__(self, config: K3HybridConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        self.prefix = prefix
        self.config = config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        if vllm_config.speculative_config is not None:
            raise ValueError("the K3 vLLM plugin does not support speculative decoding")
        forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"duplicate layer name {prefix}")
        forward_context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return kda_state_shape(self.config)

    def get_state_dtype(self):
        return kda_state_dtype(self.model_config, self.cache_config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N,D], requests laid out decodes first, then prefills."""
        x = hidden_states
        heads = (x.shape[0], self.num_heads, self.head_dim)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        o = torch.zeros(heads, dtype=x.dtype, device=x.device)  # KDA's output dtype, as in the HF layer
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict) and self.prefix in metadata:  # absent in vLLM's dummy profiling runs
            self.attend_cached(x, g, beta, o, metadata[self.prefix])

        gate = self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = F.rms_norm(o.float(), (self.head_dim,), self.o_norm.weight.float(), self.o_norm.eps)
        o = o * torch.sigmoid(gate.float().view(heads))
        return self.o_proj(o.flatten(-2).to(x.dtype))

    def attend_cached(self, x, g, beta, out, m: GDNAttentionMetadata) -> None:
        conv_cache, recurrent_cache = self.kv_cache
        if not is_conv_state_dim_first():
            conv_cache = conv_cache.transpose(-1, -2)  # -> [slots, 3*H*K, kernel-1]
        slots = m.non_spec_state_indices_tensor.long()
        starts = m.non_spec_query_start_loc.tolist()
        if m.num_decodes:
            decodes = slice(0, m.num_decode_tokens)
            out[decodes] = self.decode_step(x[decodes], g[decodes], beta[decodes], slots[: m.num_decodes], conv_cache, recurrent_cache)
        # Prefills (whole prompts, or chunks continuing a cached state) run batched by length.
        has_state = m.has_initial_state
        for requests in same_length_groups(range(m.num_decodes, m.num_decodes + m.num_prefills), starts):
            tokens = torch.tensor([list(range(starts[r], starts[r + 1])) for r in requests], device=x.device)
            rows = torch.tensor(requests, device=x.device)
            out[tokens] = self.prefill(x[tokens], g[tokens], beta[tokens], slots[rows], has_state[rows], conv_cache, recurrent_cache)

    def decode_step(self, x, g, beta, slots, conv_cache, recurrent_cache) -> torch.Tensor:
        """One new token for each of B requests, batched: x [B,D] -> o [B,H,V]."""
        # index_select / index_copy_: faster on CPU than advanced indexing for these per-step copies
        q, k, v, conv_tails = self._short_convolutions(x[:, None], conv_cache.index_select(0, slots))
        conv_cache.index_copy_(0, slots, conv_tails.to(conv_cache.dtype))
        o, state = self.run_kda(q, k, v, g[:, None], beta[:, None], recurrent_cache.index_select(0, slots), "recurrent")
        recurrent_cache.index_copy_(0, slots, state.to(recurrent_cache.dtype))
        return o[:, 0]

    def prefill(self, x, g, beta, slots, has_state, conv_cache, recurrent_cache) -> torch.Tensor:
        """T tokens for each of B requests: x [B,T,D] -> o [B,T,H,V]. A request without a cached
        state starts from zeros, which is what the HF layer does at the start of a sequence."""
        conv_tails = torch.where(has_state.view(-1, 1, 1), conv_cache[slots], 0)
        q, k, v, conv_tails = self._short_convolutions(x, conv_tails)
        conv_cache[slots] = conv_tails.to(conv_cache.dtype)
        initial = torch.where(has_state.view(-1, 1, 1, 1), recurrent_cache[slots], 0)
        o, state = self.run_kda(q, k, v, g, beta, initial, "chunk")
        recurrent_cache[slots] = state.to(recurrent_cache.dtype)
        return o

    def run_kda(self, q, k, v, g, beta, initial_state, mode: str):
        """q,k,v [B,T,H*K] after the short convolutions; g [B,T,H,K]; beta [B,T,H]."""
        heads = (*q.shape[:2], self.num_heads, self.head_dim)
        return kda_ops(
            l2norm(q.float().view(heads)), l2norm(k.float().view(heads)), v.view(heads), g, beta,
            initial_state=initial_state, output_final_state=True, mode=mode,
        )


def same_length_groups(requests: Iterable[int], starts: list[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for r in requests:
        groups.setdefault(starts[r + 1] - starts[r], []).append(r)
    return list(groups.values())
