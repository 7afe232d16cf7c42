"""Kimi Delta Attention (KDA): the linear-attention layer of the K3 hybrid backbone.

Per head the layer keeps a state S [K, V] and, for every token t (reference k3-architecture.md §1.1):

    S   <- Diag(exp(g_t)) S                  decay, one rate per key channel
    S   <- S + beta_t k_t (v_t - S^T k_t)^T    delta rule: read the decayed state, correct it
    o_t  = S^T (scale q_t)

`recurrent_kda` runs this token by token (decode, and the test oracle). `chunk_kda` computes the
same outputs a chunk of tokens at a time (§1.2): everything inside a chunk is batched matrix algebra
for all chunks at once, and only the hand-over of S from chunk to chunk is a loop.

Parameter names and shapes follow transformers' `KimiLinearDeltaAttention` in the upstream
checkpoint layout (q/k/v_conv1d, A_log, dt_bias, f_a/f_b_proj, b_proj, g_a/g_b_proj, o_norm,
o_proj), plus K3's full-rank output gate `g_proj`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

from mopd.model.config import K3HybridConfig

CHUNK_SIZE = 16  # on CPU 16 trains 1.3-1.5x faster than 32 (forward is even), and 32 beats fla's 64
SUB_CHUNK = 16  # tokens; decays inside a chunk are factored at sub-chunk boundaries
SAFE_EXPONENT = 80.0  # exp(+-80) stays a normal fp32 number


# ---------------------------------------------------------------------------------------------
# Functional ops (shared with the vLLM plugin)
# ---------------------------------------------------------------------------------------------


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla's kernels and transformers compute it."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """Log-space decay g [B,T,H,K] from the raw gate f [B,T,H,K], in fp32.

    Kimi Linear: g = -exp(A_log[h]) * softplus(f + dt_bias).
    K3 (lower_bound lb < 0): g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)), so g is in (lb, 0).
    """
    num_heads, head_dim = f.shape[-2:]
    x = f.float() + dt_bias.float().view(num_heads, head_dim)
    rate = A_log.float().view(num_heads, 1).exp()
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA. q,k [B,T,H,K] (L2-normalised), v [B,T,H,V], g [B,T,H,K], beta [B,T,H]."""
    out_dtype, dtype = v.dtype, _compute_dtype(v)
    batch, _, heads, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _initial_state(q, v, initial_state).flatten(0, 1)  # [B*H,K,V]
    # (B,H) folded into one batch dim: bmm and baddbmm ran a decode step ~3x faster than einsum
    q, k, v, g = (x.to(dtype).transpose(1, 2).flatten(0, 1) for x in (q, k, v, g))  # [B*H,T,*]
    q = q * scale
    beta = beta.to(dtype).transpose(1, 2).flatten(0, 1)
    outputs = []
    # A decode step is bound by passes over the state (2 MB for 64 requests here). Without autograd
    # the delta update changes the freshly decayed state in place (never the caller's), which spares
    # baddbmm's copy of its input: 1.5 -> 1.1 ms a layer at batch 64 (median of 3 alternated runs).
    delta_update = torch.baddbmm if torch.is_grad_enabled() else torch.Tensor.baddbmm_
    for t in range(q.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t].unsqueeze(1)
        correction = beta[:, t, None, None] * (v[:, t].unsqueeze(1) - torch.bmm(k_t, state))
        state = delta_update(state, k_t.mT, correction)
        outputs.append(torch.bmm(q[:, t].unsqueeze(1), state))
    o = torch.cat(outputs, dim=1).unflatten(0, (batch, heads)).transpose(1, 2).to(out_dtype)
    return o, state.unflatten(0, (batch, heads)) if output_final_state else None


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA, same contract and result as `recurrent_kda` (any T: the tail chunk is padded).
    g must be a decay (g <= 0), as both gates produce.

    Inside a chunk, with G = cumsum(g) and u the corrected values the delta rule writes,
    (I + A) u = beta*v - beta*(exp(G)*k) S0 where A[i,j] = beta_i sum_d k_id k_jd exp(G_id - G_jd), j < i.
    So u = U - W S0 with U, W from one triangular solve per chunk, and the chunk's outputs and final
    state follow from S0 and u by matrix products.
    """
    seq_len = q.shape[1]
    out_dtype, dtype = v.dtype, _compute_dtype(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _initial_state(q, v, initial_state)
    # [B,H,N,C,*]; padded tail tokens have g=0, k=v=beta=0 and change nothing
    q, k, v, g, beta = (_split_chunks(x.to(dtype), chunk_size) for x in (q, k, v, g, beta))
    q = q * scale
    # Log decays are always sums of g over the span they cover, never differences of two prefix
    # sums: at |sum| ~ 100 such a difference loses ~1e-5 in fp32.
    decay_in = _prefix_sum(g)  # chunk start -> token i, inclusive
    decay_out = _suffix_sum(g)  # token i (exclusive) -> chunk end
    from_chunk_start = _exp_decay(decay_in)

    scores_k, scores_q = _intra_chunk_scores(q, k, g)
    W, U = _wy_representation(scores_k, k * from_chunk_start, v, beta)
    states, corrected_values, final_state = _pass_state_across_chunks(
        W, U, k * _exp_decay(decay_out), from_chunk_start[..., -1, :], state
    )

    o = (q * from_chunk_start) @ states + scores_q @ corrected_values  # [B,H,N,C,V]
    o = o.flatten(2, 3)[:, :, :seq_len].transpose(1, 2).to(out_dtype)
    return o, final_state if output_final_state else None


def _exp_decay(log_decay: Tensor) -> Tensor:
    """exp of a log decay, floored at exp(-80): smaller decays are zero for all purposes, and exp
    with a denormal or zero result is ~30x slower on CPU."""
    return log_decay.clamp(min=-SAFE_EXPONENT).exp()


def _compute_dtype(v: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (a tighter oracle in tests)."""
    return torch.promote_types(v.dtype, torch.float32)


def _initial_state(q: Tensor, v: Tensor, initial_state: Tensor | None) -> Tensor:
    batch, _, num_heads, key_dim = q.shape
    dtype = _compute_dtype(v)
    if initial_state is None:
        return q.new_zeros(batch, num_heads, key_dim, v.shape[-1], dtype=dtype)
    return initial_state.to(dtype)


def _split_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """[B,T,H,*] -> [B,H,N,C,*], zero-padding T up to a multiple of chunk_size."""
    x = x.transpose(1, 2)
    pad = -x.shape[2] % chunk_size
    x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.unflatten(2, (-1, chunk_size))


def _prefix_sum(g: Tensor) -> Tensor:
    """sum of g[t] over t <= i along dim -2 (a matmul: on CPU faster than cumsum for short spans)."""
    n = g.shape[-2]
    return torch.ones(n, n, dtype=g.dtype, device=g.device).tril() @ g


def _suffix_sum(g: Tensor) -> Tensor:
    """sum of g[t] over t > i along dim -2."""
    n = g.shape[-2]
    return torch.ones(n, n, dtype=g.dtype, device=g.device).triu(1) @ g


def _intra_chunk_scores(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """A_kk[i,j] for j < i and A_qk[i,j] for j <= i (0 elsewhere), per chunk [B,H,N,C,C], where
    A_xk[i,j] = sum_d x_id k_jd exp(D_ijd), D_ij = g_{j+1} + ... + g_i the log decay from j to i.

    Computing exp(D) for every pair would cost [C,C,K] exps per chunk. Instead, with sub-chunks
    of 16 tokens, the decay of a pair i in sub-chunk I, j in an earlier sub-chunk J is a product of
    three factors, each <= 1 (g <= 0): from j to the end of J, across the sub-chunks strictly
    between J and I, and from the start of I to i. A pair inside one sub-chunk takes the same form
    with a middle factor exp(-(decay of the whole sub-chunk)) >= 1; where that could overflow
    (never with K3's bounded gate, 16 * 5 <= 80), those pairs use the exact pairwise decay instead.
    """
    chunk, dtype = k.shape[-2], k.dtype
    sub = math.gcd(chunk, SUB_CHUNK)
    n_sub = chunk // sub
    g_sub, k_sub = g.unflatten(-2, (-1, sub)), k.unflatten(-2, (-1, sub))  # [B,H,N,S,sub,K]
    from_start = _exp_decay(_prefix_sum(g_sub))
    k_to_end = k_sub * _exp_decay(_suffix_sum(g_sub))
    sub_chunk_decay = g_sub.sum(dim=-2)  # [..,S,K]

    factor_own_sub_chunk = bool(-sub_chunk_decay.min() <= SAFE_EXPONENT)
    log_middle = torch.einsum("ijs,...sk->...ijk", _strictly_between(n_sub, dtype, k.device), sub_chunk_decay)
    if factor_own_sub_chunk:
        own = torch.eye(n_sub, dtype=torch.bool, device=k.device).unsqueeze(-1)
        log_middle = log_middle - own * sub_chunk_decay.unsqueeze(-2)
    covered = torch.ones(n_sub, n_sub, dtype=torch.bool, device=k.device).tril(0 if factor_own_sub_chunk else -1)
    middle = torch.where(covered.unsqueeze(-1), _exp_decay(log_middle), 0)  # [..,S_I,S_J,K]
    keys = (middle.unsqueeze(-2) * k_to_end.unsqueeze(-4)).flatten(-3, -2).transpose(-1, -2)  # [..,S_I,K,C]

    exact_own = None if factor_own_sub_chunk else k_sub.unsqueeze(-3) * _pair_decay(g_sub)
    scores = []
    for x in (k, q):
        x_sub = x.unflatten(-2, (-1, sub))
        s = (x_sub * from_start) @ keys  # [..,S,sub,C]
        if exact_own is not None:
            s = s + _on_diagonal_blocks((x_sub.unsqueeze(-2) * exact_own).sum(-1))
        scores.append(s.flatten(-3, -2))
    return scores[0].tril(-1), scores[1].tril()


def _strictly_between(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """mask[I,J,s] = 1 where J < s < I."""
    s = torch.arange(n, device=device)
    return ((s[None, None, :] < s[:, None, None]) & (s[None, None, :] > s[None, :, None])).to(dtype)


def _pair_decay(g_sub: Tensor) -> Tensor:
    """exp(g_{j+1} + ... + g_i) for j <= i inside each sub-chunk, 0 for j > i: [..,sub_i,sub_j,K]."""
    sub = g_sub.shape[-2]
    t = torch.arange(sub, device=g_sub.device)
    after_j = (t[:, None] > t[None, :]).unsqueeze(-1)  # [t, j, 1]
    log_decay = (g_sub.unsqueeze(-2) * after_j).cumsum(dim=-3)
    return torch.where((t[:, None] >= t[None, :]).unsqueeze(-1), _exp_decay(log_decay), 0)


def _on_diagonal_blocks(blocks: Tensor) -> Tensor:
    """[..,S,sub,sub] per-sub-chunk blocks -> [..,S,sub,C] rows with each block at its own columns."""
    n_sub = blocks.shape[-3]
    on_diagonal = torch.eye(n_sub, device=blocks.device)[:, None, :, None]  # [S,1,S,1]
    return (blocks.unsqueeze(-2) * on_diagonal).flatten(-2)


def _wy_representation(scores_k: Tensor, k_decayed: Tensor, v: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """W = (I + A)^-1 (beta * k_decayed), U = (I + A)^-1 (beta * v), all chunks in one triangular solve."""
    key_dim = k_decayed.shape[-1]
    b = beta.unsqueeze(-1)
    unit_lower = b * scores_k + torch.eye(k_decayed.shape[-2], device=v.device)
    rhs = b * torch.cat([k_decayed, v], dim=-1)
    # solved transposed (X^T L^T = rhs^T): the transposed views are the column-major layout LAPACK wants
    WU = torch.linalg.solve_triangular(unit_lower.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    return WU[..., :key_dim], WU[..., key_dim:]


def _pass_state_across_chunks(
    W: Tensor, U: Tensor, k_to_end: Tensor, chunk_decay: Tensor, state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part: per chunk, u = U - W S, then S <- chunk_decay * S + k_to_end^T u.

    Returns the state entering each chunk [B,H,N,K,V], the corrected values u [B,H,N,C,V], and
    the state after the last chunk.
    """
    batch, heads = state.shape[:2]
    # (B,H) folded into one batch dim for baddbmm, which fuses each product with its sum
    per_chunk = (W, U, k_to_end.transpose(-1, -2), chunk_decay.unsqueeze(-1))
    per_chunk = [x.flatten(0, 1).unbind(1) for x in per_chunk]
    state = state.flatten(0, 1)
    entering, corrected = [], []
    for W_n, U_n, k_n, decay_n in zip(*per_chunk, strict=True):
        entering.append(state)
        u = torch.baddbmm(U_n, W_n, state, alpha=-1)
        corrected.append(u)
        state = torch.baddbmm(decay_n * state, k_n, u)
    heads_back = (0, (batch, heads))
    entering, corrected = torch.stack(entering, dim=1), torch.stack(corrected, dim=1)
    return entering.unflatten(*heads_back), corrected.unflatten(*heads_back), state.unflatten(*heads_back)


@functools.cache
def _fla_kernels():
    """fla's Triton kernels (chunk_kda, fused_recurrent_kda) when installed, else None."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    except ImportError:
        return None
    return fla_chunk, fla_recurrent


def kda_ops(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
) -> tuple[Tensor, Tensor | None]:
    """Run KDA with fla's kernels on CUDA when fla is importable, else with the torch ops above.

    Inputs as for `chunk_kda` (g activated, beta sigmoided, q/k normalised); mode "chunk" or "recurrent".
    """
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"kda_ops: mode must be 'chunk' or 'recurrent', got {mode!r}")
    fla = _fla_kernels() if q.is_cuda else None
    if fla is not None:
        kernel = fla[0] if mode == "chunk" else fla[1]
        return kernel(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
        )
    kernel = chunk_kda if mode == "chunk" else recurrent_kda
    return kernel(q, k, v, g, beta, scale, initial_state, output_final_state)


# ---------------------------------------------------------------------------------------------
# Layer
# ---------------------------------------------------------------------------------------------


class ShortConvolution(nn.Conv1d):
    """Causal depthwise conv + SiLU over [B,T,C]; the cache is the last kernel-1 inputs (pre-conv).
    KDA runs its q, k and v convolutions as one (`short_convolution` on their concatenated weights)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)  # causal padding: short_convolution

    def forward(self, x: Tensor, cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [B,T,C], cache [B,C,kernel-1] or None (start of sequence) -> (y [B,T,C], new cache)."""
        return short_convolution(x, self.weight, cache)


def short_convolution(x: Tensor, weight: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor]:
    """SiLU(causal depthwise conv of x [B,T,C] with weight [C,1,W]), and the last W-1 inputs [B,C,W-1]
    as the next call's cache (zeros before the start of a sequence)."""
    width = weight.shape[-1]
    x = x.transpose(1, 2)
    history = F.pad(x, (width - 1, 0)) if cache is None else torch.cat([cache.to(x.dtype), x], dim=-1)
    if x.shape[-1] == 1:  # one decode step: a dot product per channel beats conv1d's set-up
        y = (history * weight.squeeze(1)).sum(-1, keepdim=True)
    else:
        y = F.conv1d(history, weight, groups=weight.shape[0])
    # SiLU on the contiguous [B,T,C] layout: its backward on the transposed view took 3x longer
    return F.silu(y.transpose(1, 2).contiguous()), history[..., history.shape[-1] - (width - 1):]


@dataclass
class KDAState:
    """What one KDA layer carries between forward calls; its size does not grow with the sequence.

    conv: [B, 3*H*K, kernel-1], the last inputs of the q, k and v convolutions (channels packed q|k|v);
    recurrent: [B, H, K, V] fp32.
    """

    conv: Tensor
    recurrent: Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3HybridConfig, layer_idx: int):
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads = H = lac["num_heads"]
        self.head_dim = K = lac["head_dim"]
        self.lower_bound = lac["gate_lower_bound"]
        self.use_full_rank_gate = lac["use_full_rank_gate"]
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be negative or null, got {self.lower_bound}")
        D, HK = config.hidden_size, H * K

        self.q_proj = nn.Linear(D, HK, bias=False)
        self.k_proj = nn.Linear(D, HK, bias=False)
        self.v_proj = nn.Linear(D, HK, bias=False)
        self.q_conv1d = ShortConvolution(HK, lac["short_conv_kernel_size"])
        self.k_conv1d = ShortConvolution(HK, lac["short_conv_kernel_size"])
        self.v_conv1d = ShortConvolution(HK, lac["short_conv_kernel_size"])
        self.A_log = nn.Parameter(torch.empty(1, 1, H, 1))
        self.dt_bias = nn.Parameter(torch.empty(HK))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, HK, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(D, HK, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, HK, bias=False)
        self.o_norm = nn.RMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(HK, D, bias=False)
        self.packed: tuple[Tensor, Tensor] | None = None  # see pack_for_inference
        self.reset_kda_parameters()

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """Init of the parameters a generic Linear/Norm init does not cover: call it from
        `PreTrainedModel._init_weights`. Like transformers' inits it skips parameters already loaded
        from a checkpoint (`_is_hf_initialized`).

        A_log = log U(1, 16) (fla, torchtitan K3). dt_bias: 0 for K3's bounded gate (torchtitan);
        for the Kimi Linear gate, softplus^-1 of dt ~ logU(1e-3, 1e-1) (fla, transformers).
        """
        init.copy_(self.A_log, init.uniform_(self.A_log, a=1.0, b=16.0).log())
        if self.lower_bound is None:
            init.uniform_(self.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
            dt = self.dt_bias.exp().clamp_min(1e-4)
            init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        else:
            init.zeros_(self.dt_bias)
        init.ones_(self.o_norm.weight)

    def forward(
        self,
        hidden_states: Tensor,
        state: KDAState | None = None,
        attention_mask: Tensor | None = None,
        use_cache: bool = False,
    ) -> tuple[Tensor, KDAState | None]:
        """hidden_states [B,T,D]; attention_mask [B,T] with 0 at (left) padding -> (out [B,T,D], state)."""
        x = hidden_states
        if attention_mask is not None:
            # zero input at padding keeps q,k,v at 0, so left padding leaves the state at 0;
            # a decode step may pass the whole [B, past+T] mask, whose last T columns are ours
            x = x * attention_mask[:, -x.shape[1]:, None].to(x.dtype)
        batch, seq_len, _ = x.shape
        heads = (batch, seq_len, self.num_heads, self.head_dim)

        q, k, v, conv_cache = self._short_convolutions(x, None if state is None else state.conv)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        mode = "recurrent" if seq_len == 1 and state is not None else "chunk"
        o, recurrent = kda_ops(
            l2norm(q.float().view(heads)), l2norm(k.float().view(heads)), v.view(heads), g, beta,
            initial_state=None if state is None else state.recurrent, output_final_state=use_cache, mode=mode,
        )

        gate = self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = F.rms_norm(o.float(), (self.head_dim,), self.o_norm.weight.float(), self.o_norm.eps)
        o = o * torch.sigmoid(gate.float().view(heads))
        out = self.o_proj(o.flatten(-2).to(x.dtype))
        return out, KDAState(conv_cache, recurrent) if use_cache else None

    def _short_convolutions(self, x: Tensor, conv_cache: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """SiLU(ShortConv(W x)) for q, k and v as one projection and one convolution over their
        concatenated channels (q|k|v, the layout of conv_cache), which costs a third of the calls."""
        projection, kernel = self.qkv_weights()
        y, cache = short_convolution(F.linear(x, projection), kernel, conv_cache)
        q, k, v = y.chunk(3, dim=-1)
        return q, k, v, cache

    def qkv_weights(self) -> tuple[Tensor, Tensor]:
        """The q|k|v projection [3*H*K, D] and convolution kernel [3*H*K, 1, W]."""
        if self.packed is not None and not torch.is_grad_enabled():
            return self.packed
        branches = ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        return torch.cat([proj.weight for proj, _ in branches]), torch.cat([conv.weight for _, conv in branches])

    @torch.no_grad()
    def pack_for_inference(self) -> None:
        """Keep `qkv_weights` for forwards without autograd (see `LatentMoE.pack_for_inference`)."""
        self.packed = None
        self.packed = self.qkv_weights()
