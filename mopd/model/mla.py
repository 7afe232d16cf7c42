"""Gated Multi-head Latent Attention (K3) with NoPE; plain Kimi Linear MLA when the gate is off.

q = W_qb RMSNorm(W_qa x) (or W_q x when `q_lora_rank` is None); [c_kv ; k_r] = W_kva x;
[k_nope ; v] = W_kvb RMSNorm(c_kv) per head; k = [k_nope ; k_r shared by all heads]. The "rope"
slice is never rotated: KDA layers carry position. K3 multiplies the attention output by
sigmoid(W_g x) before W_o. The generation cache keeps only the normed latent and k_r, i.e.
`kv_lora_rank + qk_rope_head_dim` numbers per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mopd.model.config import K3HybridConfig

# q_a_layernorm / kv_a_layernorm use this eps upstream (not config.rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, config: K3HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.q_lora_rank = config.q_lora_rank
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scaling = config.qk_head_dim**-0.5
        d, h = config.hidden_size, config.num_attention_heads

        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.g_proj = nn.Linear(d, h * config.v_head_dim, bias=False) if config.mla_use_output_gate else None
        self.o_proj = nn.Linear(h * config.v_head_dim, d, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """hidden_states [B,T,D]; attention_mask [B, past+T] (1 = token, 0 = padding) or None."""
        batch, seq_len, _ = hidden_states.shape
        query = self.project_query(hidden_states)
        latent, k_rope = self.compress_kv(hidden_states)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)
        key, value = self.expand_kv(latent, k_rope)

        mask = attention_bias_mask(attention_mask, seq_len, key.shape[2], query.device)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None and seq_len > 1, scale=self.scaling
        )
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out)

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], self.num_heads, -1).transpose(1, 2)

    def compress_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token latent the cache stores: normed c_kv [B,1,T,kv_lora_rank] and k_r [B,1,T,rope]."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c_kv).unsqueeze(1), k_rope.unsqueeze(1)

    def expand_kv(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, length, _ = latent.shape
        kv = self.kv_b_proj(latent.squeeze(1)).view(batch, length, self.num_heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return key, value


def attention_bias_mask(
    attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean [B,1,q_len,kv_len] mask: causal, padding keys hidden; None when plain causal is enough.

    Queries are the last `q_len` of `kv_len` positions. A padding query keeps its own position so its
    softmax row is never empty (its output is ignored anyway).
    """
    past = kv_len - q_len
    if attention_mask is None and (past == 0 or q_len == 1):
        return None
    q_pos = torch.arange(past, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
    return allowed | (k_pos == q_pos)[None, None]
