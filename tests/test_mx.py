"""MX formats and quantization-aware training of the routed experts (mopd.model.mx): torchao's
rounding, the packed MXFP4 checkpoint, the straight-through gradient, and serving the packed
checkpoint through the vLLM plugin against the fake-quantized HF model."""

from __future__ import annotations

import json

import pytest
import torch

from mopd.model import K3HybridForCausalLM, preset_config
from mopd.model.export import (
    ExportError,
    export_mxfp4,
    qat_start,
    routed_expert_bytes,
    with_routed_expert_mx,
)
from mopd.model.moe import LatentMoE
from mopd.model.mx import fake_quantize, pack_mxfp4, quantize_dequantize, torchao_mx, unpack_mxfp4
from mopd.recipe import RecipeError, load_recipe
from mopd.rollout.checkpoint import write_random_checkpoint

FORMATS = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}


def torchao_round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    mx = torchao_mx()
    scale, data = mx.to_mx(x.contiguous(), FORMATS[fmt], 32)
    return mx.to_dtype(data, scale, FORMATS[fmt], 32, x.dtype)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(64, 64), (512, 256), (16, 8, 32)])
def test_the_rounding_equals_torchaos_bit_for_bit_on_random_tensors(shape, fmt):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) * 10
    assert torch.equal(quantize_dequantize(x, fmt), torchao_round_trip(x, fmt))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_round_trip_is_torchaos_and_a_partial_block_rounds_as_a_zero_padded_one(fmt):
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(0)) * 3
    out = quantize_dequantize(x, fmt)
    assert torch.equal(out[:, :32], torchao_round_trip(x[:, :32], fmt))
    padded_tail = torch.nn.functional.pad(x[:, 32:], (0, 16))
    assert torch.equal(out[:, 32:], torchao_round_trip(padded_tail, fmt)[:, :16])
    assert not torch.equal(out, x)
    assert torch.equal(quantize_dequantize(out, fmt), out)  # MX values are fixed points of the rounding


EDGES = {
    "ties": torch.arange(256.0).view(4, 64) / 8 - 16,  # every half step of both element grids
    "grid": torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, -0.25, -2.5, -5.0, 1e-3, 8.0, 0.125, 3.0] * 4),
    "zeros": torch.zeros(4, 64),
    "near the least normal float": torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 1e-38,
    "huge": torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 1e38,
    "one outlier": torch.cat([torch.full((4, 1), 1000.0), torch.randn(4, 63, generator=torch.Generator().manual_seed(5))], 1),
    "bf16": (torch.randn(8, 64, generator=torch.Generator().manual_seed(6)) * 3).bfloat16(),
}


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("name", list(EDGES))
def test_the_rounding_equals_torchaos_bit_for_bit_at_ties_saturation_and_tiny_scales(name, fmt):
    x = EDGES[name].reshape(-1, 64)
    assert torch.equal(quantize_dequantize(x, fmt), torchao_round_trip(x, fmt))


def test_mxfp4_packing_is_torchaos_layout_and_unpacks_to_the_rounded_weight():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed, scale = pack_mxfp4(w)
    ao_scale, ao_data = torchao_mx().to_mx(w, torch.float4_e2m1fn_x2, 32)
    assert torch.equal(packed, ao_data) and torch.equal(scale, ao_scale.view(torch.uint8))
    ragged = torch.randn(8, 48, generator=torch.Generator().manual_seed(2))
    packed, scale = pack_mxfp4(ragged)
    assert packed.shape == (8, 24) and scale.shape == (8, 2) and packed.dtype == scale.dtype == torch.uint8
    assert torch.equal(unpack_mxfp4(packed, scale), quantize_dequantize(ragged, "mxfp4"))


def test_fake_quantization_rounds_the_forward_and_passes_the_gradient_straight_through():
    x = torch.randn(4, 64, requires_grad=True)
    y = fake_quantize(x, "mxfp4")
    assert torch.equal(y, quantize_dequantize(x, "mxfp4"))
    upstream = torch.randn(4, 64)
    (y * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)


def moe_pair(mx: dict):
    """A quantized LatentMoE and a plain one whose expert weights are the quantized one's, rounded."""
    torch.manual_seed(0)
    quantized = LatentMoE(preset_config("tiny", routed_expert_mx=mx))
    with torch.no_grad():
        for param in quantized.parameters():
            param.normal_(0.0, 0.2)
    plain = LatentMoE(preset_config("tiny"))
    plain.load_state_dict(quantized.state_dict())
    with torch.no_grad():
        for expert in plain.experts:
            for linear in (expert.w1, expert.w2, expert.w3):
                linear.weight.copy_(quantize_dequantize(linear.weight, mx["weights"]))
    return quantized, plain


@pytest.mark.parametrize("tokens", [6, 2048])  # the dense path (every expert on every token) and the sparse one
def test_quantized_experts_compute_on_the_rounded_weights_and_train_the_full_precision_ones(tokens):
    quantized, plain = moe_pair({"weights": "mxfp4", "activations": None})
    x = torch.randn(1, tokens, quantized.config.hidden_size)
    out_q, out_p = quantized(x), plain(x)
    assert torch.equal(out_q, out_p)
    upstream = torch.randn_like(out_q)
    (out_q * upstream).sum().backward()
    (out_p * upstream).sum().backward()
    for eq, ep in zip(quantized.experts, plain.experts, strict=True):
        assert torch.equal(eq.w1.weight.grad, ep.w1.weight.grad)  # straight through: d/dW f(q(W)) = f'(q(W))
        assert torch.equal(eq.w2.weight.grad, ep.w2.weight.grad)
    assert quantized.experts[0].w1.weight.dtype == torch.float32  # master weights stay full precision
    assert not torch.equal(quantized.experts[0].w1.weight, plain.experts[0].w1.weight)


def test_quantized_activations_change_only_the_routed_experts():
    quantized, _ = moe_pair({"weights": "mxfp4", "activations": "mxfp8"})
    x = torch.randn(1, 6, quantized.config.hidden_size)
    with torch.no_grad():
        dense = quantized(x)
        quantized.activation_format = None
        without = quantized(x)
    assert not torch.equal(dense, without)  # the experts' inputs are rounded
    assert quantized.shared_experts.gate_proj.weight.dtype == torch.float32


def test_packed_checkpoint_stores_experts_at_0_27_of_bf16_and_qat_refuses_a_model_that_is_not_k3(tmp_path):
    write_random_checkpoint(tmp_path / "full", "tiny", seed=0)
    export_mxfp4(tmp_path / "full", tmp_path / "packed")
    size = routed_expert_bytes(tmp_path / "packed")
    assert size["stored"] / size["bf16"] <= 0.27
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config["routed_expert_mx"] == {"weights": "mxfp4", "activations": "mxfp8"}
    with pytest.raises(ExportError, match="stored packed"):
        with_routed_expert_mx(tmp_path / "packed", tmp_path / "again", None)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ExportError, match=r"distill\.qat: QAT quantizes a K3 hybrid's routed experts; .*llama"):
        qat_start(tmp_path / "llama", {"weights": "mxfp4", "activations": None}, tmp_path / "run", "distill.qat")


@pytest.mark.parametrize(
    "override, field",
    [("distill.qat.experts=mxfp3", "distill.qat.experts"), ("distill.qat.activations=int8", "distill.qat.activations"),
     ("teachers.common.qat.experts=fp4", "qat.experts")],
)  # fmt: skip
def test_a_bad_qat_format_is_refused_naming_the_field(override, field):
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        recipe = load_recipe("recipes/tiny.yaml", [override])
        from mopd.recipe import load_teacher_specs

        load_teacher_specs(recipe)


def test_the_packed_checkpoint_served_by_vllm_scores_as_the_fake_quantized_hf_model(tmp_path):
    """MX rounding is deterministic, so the packed checkpoint's log-probs differ from the fake-quantized
    HF model's only by fp32 compute order (the plugin tests' tolerance), far less than MX rounding moves them."""
    from mopd.rollout.vllm_backend import VllmEngine

    mx = {"weights": "mxfp4", "activations": "mxfp8"}
    write_random_checkpoint(tmp_path / "full", "tiny", seed=0)
    with_routed_expert_mx(tmp_path / "full", tmp_path / "fake", mx)
    export_mxfp4(tmp_path / "full", tmp_path / "packed", activations="mxfp8")
    fake = K3HybridForCausalLM.from_pretrained(tmp_path / "fake", dtype=torch.float32).eval()
    full = K3HybridForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 100)]
    engine = VllmEngine(tmp_path / "packed", max_model_len=256, max_num_seqs=4)
    try:
        served = engine.prompt_logprobs(prompts)
    finally:
        engine.close()
    for prompt, logprobs in zip(prompts, served, strict=True):
        reference = prompt_logprobs(fake, prompt)
        assert (reference - torch.tensor(logprobs)).abs().max() < 1e-3
        assert (reference - prompt_logprobs(full, prompt)).abs().max() > 1e-2


@torch.no_grad()
def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)


def test_transformers_loads_a_packed_checkpoint_as_the_fake_quantized_model(tmp_path):
    from transformers import AutoModelForCausalLM

    write_random_checkpoint(tmp_path / "full", "tiny", seed=0)
    with_routed_expert_mx(tmp_path / "full", tmp_path / "fake", {"weights": "mxfp4", "activations": "mxfp8"})
    export_mxfp4(tmp_path / "full", tmp_path / "packed", activations="mxfp8")
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "packed", dtype=torch.float32)
    fake = K3HybridForCausalLM.from_pretrained(tmp_path / "fake", dtype=torch.float32)
    prompt = list(range(3, 40))
    assert torch.equal(prompt_logprobs(packed, prompt), prompt_logprobs(fake, prompt))
