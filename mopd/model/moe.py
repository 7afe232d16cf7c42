"""K3 Stable LatentMoE (and plain Kimi Linear MoE when `routed_expert_hidden_size` is None).

Router: sigmoid scores on the full-width input in fp32; the selection bias picks the top-k experts,
the unbiased scores (renormalised, times `routed_scaling_factor`) weight them. Routed experts run
in a latent width: down-project, experts, optional RMSNorm, up-project. Shared experts run at full
width. Module and weight names follow the upstream checkpoints (`block_sparse_moe.*`).

With `config.routed_expert_mx` the routed experts compute in MX formats (`mopd.model.mx`): their
weights and their inputs (the latent tokens, and the gated activations entering each down
projection) are rounded in the forward and passed straight through in the backward. The router,
shared experts and latent projections stay in full precision, as in K3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mopd.model.balancing import quantile_bias_update, sign_bias_update
from mopd.model.config import K3HybridConfig
from mopd.model.mx import fake_quantize

# Below this many (token, expert) pairs every expert runs on every token, weighted 0 where it was
# not chosen: two matmuls beat a gather, an expert call and a scatter per expert. On CPU with the
# tiny preset (8 experts): 2x faster at 64 tokens (a decode step), equal at 1,024.
DENSE_EXPERT_PAIRS = 8192


def gated_activation(gate: torch.Tensor, up: torch.Tensor, config: K3HybridConfig) -> torch.Tensor:
    """SiLU-GLU, or K3's SiTU-GLU: β·tanh(g/β)·σ(g) ⊙ β_lin·tanh(u/β_lin), computed in fp32."""
    if config.hidden_act == "silu":
        return F.silu(gate) * up
    beta, beta_lin = config.activation_situ_beta, config.activation_situ_linear_beta
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
    return out.to(gate.dtype)


class GatedMLP(nn.Module):
    """Dense MLP and shared experts (upstream names gate_proj / up_proj / down_proj)."""

    def __init__(self, config: K3HybridConfig, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.config))


class Expert(nn.Module):
    """One routed expert (upstream names w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, config: K3HybridConfig, width: int):
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w3 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(config.moe_intermediate_size, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(gated_activation(self.w1(x), self.w3(x), self.config))


class Router(nn.Module):
    """Sigmoid top-k router with a selection-only bias; counts expert load while training."""

    def __init__(self, config: K3HybridConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.balance = config.moe_balance
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # fp32 in any model dtype (as DeepSeek-V3's): a bf16 bias would round away the balancing updates
        # and pick other experts than the fp32 bias the checkpoint stores
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.step_load: torch.Tensor | None = None
        self.step_scores: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,D] -> combine weights [N,k] (fp32) and expert indices [N,k]."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        indices = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.training and torch.is_grad_enabled():  # the tokens this optimizer step learns from
            self.record_load(scores.detach(), indices, token_mask)
        return weights * self.scaling, indices

    def record_load(
        self, scores: torch.Tensor, indices: torch.Tensor, token_mask: torch.Tensor | None
    ) -> None:
        if token_mask is not None:
            scores, indices = scores[token_mask], indices[token_mask]
        load = torch.bincount(indices.flatten(), minlength=scores.shape[-1]).float()
        self.step_load = load if self.step_load is None else self.step_load + load
        if self.balance == "quantile":
            self.step_scores.append(scores)

    @torch.no_grad()
    def update_bias(self, rate: float, speed: float) -> None:
        """Apply this step's balancing rule to the bias, then start a new step."""
        if self.balance == "quantile" and self.step_scores:
            new = quantile_bias_update(
                torch.cat(self.step_scores), self.e_score_correction_bias, self.top_k, rate
            )
            self.e_score_correction_bias.copy_(new)
        elif self.balance == "sign" and self.step_load is not None:
            new = sign_bias_update(self.step_load, self.e_score_correction_bias, speed)
            self.e_score_correction_bias.copy_(new)
        self.step_load, self.step_scores = None, []


class LatentMoE(nn.Module):
    def __init__(self, config: K3HybridConfig):
        super().__init__()
        d, latent = config.hidden_size, config.routed_expert_hidden_size
        self.config = config
        self.gate = Router(config)
        self.experts = nn.ModuleList(Expert(config, latent or d) for _ in range(config.num_experts))
        self.routed_expert_down_proj = nn.Linear(d, latent, bias=False) if latent else None
        use_norm = latent is not None and config.latent_moe_use_norm
        self.routed_expert_norm = nn.RMSNorm(latent, eps=config.rms_norm_eps) if use_norm else None
        self.routed_expert_up_proj = nn.Linear(latent, d, bias=False) if latent else None
        shared_width = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = GatedMLP(config, d, shared_width) if shared_width else None
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # see pack_for_inference
        mx = config.routed_expert_mx or {}
        self.weight_format, self.activation_format = mx.get("weights"), mx.get("activations")

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,D]; token_mask [B,T] marks real tokens (padding is not counted as expert load)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat, None if token_mask is None else token_mask.reshape(-1).bool())
        routed = flat if self.routed_expert_down_proj is None else self.routed_expert_down_proj(flat)
        routed = self.run_experts(routed, weights, indices)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        if self.routed_expert_up_proj is not None:
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.view_as(x)

    @property
    def quantized(self) -> bool:
        return self.weight_format is not None or self.activation_format is not None

    def run_experts(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        h = fake_quantize(h, self.activation_format)
        if h.shape[0] * len(self.experts) <= DENSE_EXPERT_PAIRS:
            return self.run_every_expert(h, weights, indices)
        run_expert = self.quantized_expert_runner() if self.quantized else lambda idx, x: self.experts[idx](x)
        out = torch.zeros_like(h)
        for expert_idx in indices.unique().tolist():
            token_idx, slot = (indices == expert_idx).nonzero(as_tuple=True)
            y = run_expert(expert_idx, h[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def quantized_expert_runner(self):
        """One expert's forward on the MX-rounded weights, rounded once for all experts of this call."""
        gate_up, down = self.expert_matrices()
        width = self.config.moe_intermediate_size

        def run(idx: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, gate_up[2 * width * idx : 2 * width * (idx + 1)]).chunk(2, dim=-1)
            hidden = fake_quantize(gated_activation(gate, up, self.config), self.activation_format)
            return F.linear(hidden, down[:, width * idx : width * (idx + 1)])

        return run

    def run_every_expert(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum computed densely: [N,E] combine weights, 0 off the top-k."""
        num_experts = len(self.experts)
        combine = torch.zeros(h.shape[0], num_experts, dtype=weights.dtype, device=h.device)
        combine = combine.scatter(1, indices, weights).to(h.dtype)
        gate_up, down = self.expert_matrices()
        gate, up = F.linear(h, gate_up).unflatten(-1, (num_experts, 2, -1)).unbind(2)  # [N,E,I] each
        hidden = fake_quantize(gated_activation(gate, up, self.config), self.activation_format)
        hidden = hidden * combine.unsqueeze(-1)  # after the rounding: the input of each down projection
        return F.linear(hidden.flatten(1), down)

    def expert_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's gate and up rows [E*2*I, latent] and down columns [latent, E*I], MX-rounded
        per expert (blocks run along each weight's input dimension) when the experts are quantized."""
        if self.packed is not None and not torch.is_grad_enabled():
            return self.packed
        gate_up = torch.cat([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])
        down = torch.stack([e.w2.weight for e in self.experts], dim=1)  # [latent, E, I]
        gate_up, down = fake_quantize(gate_up, self.weight_format), fake_quantize(down, self.weight_format)
        return gate_up, down.flatten(1)

    @torch.no_grad()
    def pack_for_inference(self) -> None:
        """Keep `expert_matrices` for forwards without autograd, instead of concatenating 24 weights
        on every call. For an owner that sees every change of the weights and packs again (the vLLM
        plugin, after each `load_weights`): a training step would leave the packed copy stale."""
        self.packed = None
        self.packed = self.expert_matrices()
