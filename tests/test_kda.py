"""Kimi Delta Attention: chunked == recurrent, layer decode == full forward, constant state,
gradients, left padding, and parity with transformers' Kimi Linear KDA layer."""

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from mopd.model.config import preset_config
from mopd.model.kda import (
    KDAState,
    KimiDeltaAttention,
    chunk_kda,
    kda_gate,
    kda_ops,
    l2norm,
    recurrent_kda,
)

TOL = 1e-5
KIMI_GATE = {"use_full_rank_gate": False, "gate_lower_bound": None}


def kda_inputs(T, gate, B=2, H=2, K=32, V=16, seed=0):
    """q, k, v, g, beta, initial state as the layer would pass them. gate: "k3" (bounded decay),
    "kimi" (Kimi Linear gate, mild decays) or "kimi_strong" (decays of ~100 per token, for which
    the chunked form uses exact pairwise decays inside its sub-chunks)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    f = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H * K, generator=gen)
    f = {"k3": f, "kimi": 0.5 * f - 4, "kimi_strong": 10 * f + 5}[gate]
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0 if gate == "k3" else None)
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, state


# ----- functional ops -----


@pytest.mark.parametrize("gate", ["k3", "kimi", "kimi_strong"])
@pytest.mark.parametrize("T", [1, 37, 64, 130])
def test_chunked_matches_recurrent_with_initial_state(gate, T):
    q, k, v, g, beta, state = kda_inputs(T, gate)
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_chunk, s_chunk = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert (o_chunk - o_rec).abs().max() <= TOL
    assert (s_chunk - s_rec).abs().max() <= TOL


def test_recurrent_without_autograd_updates_its_own_state_not_the_callers():
    """Decode runs without autograd and updates its state in place: the same outputs and final state
    as with autograd, and the caller's initial state (vLLM's gathered cache rows) is left as it was."""
    q, k, v, g, beta, state = kda_inputs(3, "k3")
    before = state.clone()
    o_grad, s_grad = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    with torch.no_grad():
        o_fast, s_fast = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert torch.equal(state, before)
    assert (o_fast - o_grad).abs().max() <= TOL
    assert (s_fast - s_grad).abs().max() <= TOL


@pytest.mark.parametrize("chunk_size", [8, 32, 64])
def test_chunked_matches_recurrent_for_other_chunk_sizes(chunk_size):
    q, k, v, g, beta, state = kda_inputs(45, "k3")
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_chunk, s_chunk = chunk_kda(q, k, v, g, beta, None, state, True, chunk_size=chunk_size)
    assert (o_chunk - o_rec).abs().max() <= TOL
    assert (s_chunk - s_rec).abs().max() <= TOL


def test_chunked_is_as_accurate_as_recurrent_against_float64():
    """Long sequence, strong bounded decays: fp32 chunked stays within fp32 noise of an fp64 run."""
    q, k, v, g, beta, state = kda_inputs(300, "k3", seed=3)
    args64 = [x.double() for x in (q, k, v, g, beta)]
    o64, s64 = recurrent_kda(*args64, initial_state=state.double(), output_final_state=True)
    o_rec, _ = recurrent_kda(q, k, v, g, beta, initial_state=state)
    o_chunk, s_chunk = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    rec_error = (o_rec.double() - o64).abs().max()
    assert (o_chunk.double() - o64).abs().max() <= max(10 * rec_error, 1e-6)
    assert (s_chunk.double() - s64).abs().max() <= 1e-6


def test_chunked_gradients_match_recurrent():
    inputs = [x.requires_grad_() for x in kda_inputs(37, "k3")]
    grads = []
    for kernel in (recurrent_kda, chunk_kda):
        o, s = kernel(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        grads.append(torch.autograd.grad((o.square().sum() + s.square().sum()), inputs))
    for g_rec, g_chunk in zip(*grads, strict=True):
        assert torch.isfinite(g_chunk).all()
        assert (g_chunk - g_rec).abs().max() <= 1e-4 * max(1.0, g_rec.abs().max().item())


def test_gates():
    f = torch.tensor([-1e4, -3.0, 0.0, 3.0, 1e4]).view(1, 5, 1, 1)
    A_log, dt_bias = torch.tensor([0.5]), torch.tensor([0.25])
    g_k3 = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    assert ((g_k3 >= -5.0) & (g_k3 <= 0)).all()
    expected_k3 = -5.0 * torch.sigmoid(A_log.exp() * (f + dt_bias))
    assert torch.equal(g_k3, expected_k3)
    g_kimi = kda_gate(f, A_log, dt_bias)
    assert (g_kimi <= 0).all() and torch.isfinite(g_kimi).all()
    assert torch.allclose(g_kimi, -A_log.exp() * torch.nn.functional.softplus(f + dt_bias))


def test_kda_ops_runs_torch_kernels_on_cpu_and_rejects_unknown_modes():
    q, k, v, g, beta, state = kda_inputs(20, "k3")
    o, s = kda_ops(q, k, v, g, beta, initial_state=state, output_final_state=True, mode="recurrent")
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="mode"):
        kda_ops(q, k, v, g, beta, mode="fused")


# ----- layer -----


def make_layer(seed=0, **linear_attn):
    torch.manual_seed(seed)
    config = preset_config("tiny", linear_attn_config={"num_heads": 2, "head_dim": 64, **linear_attn})
    return KimiDeltaAttention(config, layer_idx=0), config


@pytest.mark.parametrize("linear_attn", [{}, KIMI_GATE], ids=["k3", "kimi_linear"])
def test_layer_prefill_then_decode_matches_full_forward(linear_attn):
    layer, config = make_layer(**linear_attn)
    x = torch.randn(2, 40, config.hidden_size)
    with torch.no_grad():
        full, _ = layer(x)
        out, state = layer(x[:, :11], use_cache=True)
        pieces = [out]
        out, state = layer(x[:, 11:30], state=state, use_cache=True)  # multi-token continuation
        pieces.append(out)
        for t in range(30, 40):
            out, state = layer(x[:, t : t + 1], state=state, use_cache=True)
            pieces.append(out)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= TOL


def test_state_size_does_not_grow_with_sequence_length():
    layer, config = make_layer()
    sizes = []
    with torch.no_grad():
        for T in (64, 4096):
            _, state = layer(torch.randn(1, T, config.hidden_size), use_cache=True)
            assert isinstance(state, KDAState)
            sizes.append(state.nbytes())
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("linear_attn", [{}, KIMI_GATE], ids=["k3", "kimi_linear"])
def test_gradients_reach_every_parameter(linear_attn):
    layer, config = make_layer(**linear_attn)
    out, _ = layer(torch.randn(2, 70, config.hidden_size))
    out.square().mean().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_left_padding_leaves_the_state_at_zero():
    layer, config = make_layer()
    x = torch.randn(1, 25, config.hidden_size)
    pad = 9
    padded = torch.cat([torch.randn(1, pad, config.hidden_size), x], dim=1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, 25)], dim=1)
    with torch.no_grad():
        out, state = layer(x, use_cache=True)
        out_padded, state_padded = layer(padded, attention_mask=mask, use_cache=True)
    assert (out_padded[:, pad:] - out).abs().max() <= TOL
    assert (state_padded.recurrent - state.recurrent).abs().max() <= TOL
    assert torch.equal(state_padded.conv, state.conv)


@pytest.mark.parametrize("linear_attn", [{}, KIMI_GATE], ids=["k3", "kimi_linear"])
def test_reset_kda_parameters_initialises_decays_and_keeps_loaded_weights(linear_attn):
    layer, _ = make_layer(**linear_attn)
    rate = layer.A_log.exp()
    assert ((rate >= 1) & (rate <= 16)).all() and rate.unique().numel() == layer.num_heads
    if layer.lower_bound is None:  # softplus(dt_bias) = dt in [1e-3, 1e-1]
        dt = torch.nn.functional.softplus(layer.dt_bias)
        assert ((dt > 0.999e-3) & (dt < 1.001e-1)).all()
    else:
        assert torch.equal(layer.dt_bias, torch.zeros_like(layer.dt_bias))

    loaded = {name: p.detach().clone() for name, p in layer.named_parameters()}
    for p in layer.parameters():
        p._is_hf_initialized = True  # what transformers sets on weights read from a checkpoint
    layer.reset_kda_parameters()
    for name, p in layer.named_parameters():
        assert torch.equal(p, loaded[name]), name


def test_positive_gate_lower_bound_is_rejected():
    with pytest.raises(ValueError, match="gate_lower_bound"):
        make_layer(gate_lower_bound=2.0)


def test_layer_matches_transformers_kimi_linear_kda():
    """Same weights (checkpoint layout renamed the way transformers' conversion mapping does) ->
    same output as transformers' KimiLinearDeltaAttention."""
    layer, config = make_layer(**KIMI_GATE)
    hf_config = KimiLinearConfig(
        hidden_size=config.hidden_size, num_hidden_layers=2, linear_num_heads=2, linear_head_dim=64,
        linear_conv_kernel_dim=4, rms_norm_eps=config.rms_norm_eps, hidden_act="silu",
        layer_types=["linear_attention", "full_attention"],
    )
    reference = KimiLinearDeltaAttention(hf_config, layer_idx=0)
    ours = layer.state_dict()
    renamed = {"conv1d.weight": torch.cat([ours.pop(f"{x}_conv1d.weight") for x in "qkv"])}
    for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        renamed[f"forget_gate.{name}"] = ours.pop(name)
    reference.load_state_dict({**renamed, **ours}, strict=True)

    x = torch.randn(2, 77, config.hidden_size)
    with torch.no_grad():
        out, _ = layer(x)
        expected = reference(x)
    assert (out - expected).abs().max() <= TOL
