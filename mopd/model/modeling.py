"""The K3-style hybrid as a transformers model: KDA and gated-MLA layers, Block AttnRes, LatentMoE.

Layer ℓ is KDA or MLA by `config.layer_types` (3:1, last layer MLA). Each layer reads its input
through Block Attention Residuals (or a plain residual stream when `attn_res_block_size` is None),
then attention, then a dense MLP (first `first_k_dense_replace` layers) or the LatentMoE. Module
names follow the upstream Kimi Linear / K3 checkpoints, so `export_kimi_linear` only rewrites
config.json.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from mopd.model.attnres import BlockResiduals, PseudoQuery, attn_res
from mopd.model.balancing import max_over_mean
from mopd.model.cache import K3HybridCache
from mopd.model.config import K3HybridConfig
from mopd.model.kda import KimiDeltaAttention
from mopd.model.mla import MLAAttention
from mopd.model.moe import GatedMLP, LatentMoE, Router
from mopd.model.mx import is_mxfp4_packed, unpack_mxfp4_weights


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = (
            KimiDeltaAttention(config, layer_idx) if self.is_kda else MLAAttention(config, layer_idx)
        )
        dense = config.mlp_layer_types[layer_idx] == "dense"
        self.mlp = GatedMLP(config, d, config.intermediate_size) if dense else None
        self.block_sparse_moe = None if dense else LatentMoE(config)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)

        # Block AttnRes pseudo-queries. Layer 0's attention input is the embedding alone (nothing to
        # mix), so it has no attention-side query.
        attn_res_on = config.attn_res_block_size is not None
        has_attention_mix = attn_res_on and layer_idx > 0
        self.self_attention_res_norm = nn.RMSNorm(d, eps=eps) if has_attention_mix else None
        self.self_attention_res_proj = PseudoQuery(d) if has_attention_mix else None
        self.mlp_res_norm = nn.RMSNorm(d, eps=eps) if attn_res_on else None
        self.mlp_res_proj = PseudoQuery(d) if attn_res_on else None

    def forward(
        self,
        residuals: BlockResiduals,
        attention_mask: torch.Tensor | None,
        cache: K3HybridCache | None,
    ) -> None:
        """Advance the depth state `residuals` by this layer's attention and MLP sublayers."""
        attention_mix = mix_fn(self.self_attention_res_norm, self.self_attention_res_proj)
        h = residuals.attention_input(self.layer_idx, attention_mix)
        residuals.add_attention(self.layer_idx, self.attend(self.input_layernorm(h), attention_mask, cache))

        h = self.post_attention_layernorm(residuals.mlp_input(mix_fn(self.mlp_res_norm, self.mlp_res_proj)))
        token_mask = None if attention_mask is None else attention_mask[:, -h.shape[1] :]
        residuals.add_mlp(self.mlp(h) if self.mlp is not None else self.block_sparse_moe(h, token_mask))

    def attend(self, h: torch.Tensor, attention_mask: torch.Tensor | None, cache: K3HybridCache | None):
        if not self.is_kda:
            return self.self_attn(h, attention_mask=attention_mask, cache=cache)
        token_mask = None if attention_mask is None else attention_mask[:, -h.shape[1] :]
        state = None if cache is None else cache.kda_state(self.layer_idx)
        out, new_state = self.self_attn(
            h, state=state, attention_mask=token_mask, use_cache=cache is not None
        )
        if cache is not None:
            cache.set_kda_state(self.layer_idx, new_state)
        return out


def mix_fn(norm: nn.RMSNorm | None, proj: nn.Linear | None):
    return None if norm is None else partial(attn_res, norm=norm, proj=proj)


class K3HybridPreTrainedModel(PreTrainedModel):
    config_class = K3HybridConfig
    config: K3HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["K3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _is_stateful = True
    # K3 checkpoints store a layer-0 attention-side AttnRes query that can never be used (one source)
    _keys_to_ignore_on_load_unexpected = [r"layers\.0\.self_attention_res_(norm|proj)\."]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # see Router

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiDeltaAttention) and not getattr(
            module.A_log, "_is_hf_initialized", False
        ):
            module.reset_kda_parameters()  # the decay parameters have their own init (skipped when loaded)
        elif isinstance(module, PseudoQuery):
            init.zeros_(module.weight)  # every AttnRes mix starts uniform over its sources (AttnRes paper)


class K3HybridModel(K3HybridPreTrainedModel):
    def __init__(self, config: K3HybridConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, config.pad_token_id)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        attn_res_on = config.attn_res_block_size is not None
        self.output_attn_res_norm = nn.RMSNorm(d, eps=config.rms_norm_eps) if attn_res_on else None
        self.output_attn_res_proj = PseudoQuery(d) if attn_res_on else None
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: K3HybridCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """attention_mask: 2D [B, past+T], 1 for tokens and 0 for padding (left padding for generation)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        cache = None
        if use_cache:
            cache = past_key_values if past_key_values is not None else K3HybridCache(self.config)
            if not isinstance(cache, K3HybridCache):
                raise TypeError(f"past_key_values must be a K3HybridCache, got {type(cache).__name__}")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None

        residuals = BlockResiduals(inputs_embeds, self.config.attn_res_block_size)
        for layer in self.layers:
            layer(residuals, attention_mask, cache)
        hidden = residuals.output(mix_fn(self.output_attn_res_norm, self.output_attn_res_proj))
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)


class K3HybridForCausalLM(K3HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: K3HybridConfig):
        super().__init__(config)
        self.model = K3HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading, except for a checkpoint whose routed experts are packed in MXFP4
        (`mopd export --quantize mxfp4`): transformers does not read that layout, so it is unpacked here."""
        path = Path(pretrained_model_name_or_path)
        if (path / "config.json").is_file() and is_mxfp4_packed(json.loads((path / "config.json").read_text())):
            return load_mxfp4_packed(cls, path, kwargs.get("dtype"))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: K3HybridCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # generate() would build a DynamicCache; the hybrid needs its own (KDA state + MLA latent).
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache:
            model_kwargs["past_key_values"] = K3HybridCache(self.config)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    # ----- aux-loss-free expert balancing -----
    def routers(self) -> dict[int, Router]:
        return {
            i: layer.block_sparse_moe.gate
            for i, layer in enumerate(self.model.layers)
            if layer.block_sparse_moe is not None
        }

    def moe_load_stats(self) -> dict[str, float]:
        """Max/mean expert load per MoE layer over the current step (training forwards since the last update)."""
        return {
            f"moe/layer{i}/max_over_mean": max_over_mean(router.step_load)
            for i, router in self.routers().items()
            if router.step_load is not None
        }

    def update_moe_bias(self) -> dict[str, float]:
        """Call once per optimizer step: apply `config.moe_balance` to each router's bias, return the step's load stats."""
        stats = self.moe_load_stats()
        for router in self.routers().values():
            router.update_bias(rate=self.config.moe_balance_rate, speed=self.config.moe_bias_update_speed)
        return stats


def active_parameters(config: K3HybridConfig) -> int:
    """N of the FLOP estimate: the parameters a token's forward multiplies by. The embedding table is
    left out (a lookup, not a matmul; counted when tied to the output head); each LatentMoE layer
    counts its router, latent projections and shared experts, and `num_experts_per_token` of its
    `num_experts` routed experts (the active parameters)."""
    with torch.device("meta"):
        model = K3HybridForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head and table are one tensor here
    if not config.tie_word_embeddings:
        total -= model.model.embed_tokens.weight.numel()
    routed = sum(
        p.numel() for layer in model.model.layers if layer.block_sparse_moe is not None
        for p in layer.block_sparse_moe.experts.parameters()
    )  # fmt: skip
    return total - routed + routed * config.num_experts_per_token // config.num_experts


def load_mxfp4_packed(cls, path: Path, dtype: torch.dtype | str | None) -> K3HybridForCausalLM:
    """A K3 checkpoint with MXFP4-packed routed experts, each dequantized into its full-precision weight;
    the config's `routed_expert_mx` then keeps the experts computing on exactly those MXFP4 values."""
    from safetensors.torch import load_file

    config = K3HybridConfig.from_pretrained(path)
    del config.quantization_config  # the weights below are unpacked: nothing is left for transformers to quantize
    model = cls(config)
    stored = {name: t for shard in sorted(path.glob("*.safetensors")) for name, t in load_file(shard).items()}
    ignored = [re.compile(p) for p in cls._keys_to_ignore_on_load_unexpected]
    state = {n: t for n, t in unpack_mxfp4_weights(stored.items()) if not any(p.search(n) for p in ignored)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not (config.tie_word_embeddings and n in cls._tied_weights_keys)]
    if missing or unexpected:
        raise ValueError(f"{path}: MXFP4 checkpoint does not match its config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return model.to(dtype or torch.float32).eval()
