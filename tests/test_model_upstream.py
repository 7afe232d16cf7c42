"""Checkpoints: upstream Kimi Linear parity through `export_kimi_linear`, safetensors round trip, Auto classes."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, KimiLinearForCausalLM

from mopd.model import K3HybridConfig, K3HybridForCausalLM, preset_config
from mopd.model.export import export_kimi_linear

KIMI_LINEAR_FEATURES = dict(
    attn_res_block_size=None,
    routed_expert_hidden_size=None,
    mla_use_output_gate=False,
    q_lora_rank=None,
    hidden_act="silu",
    linear_attn_config={
        "num_heads": 2,
        "head_dim": 64,
        "use_full_rank_gate": False,
        "gate_lower_bound": None,
    },
)


def random_ids(vocab_size: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_exported_checkpoint_loads_into_transformers_kimi_linear_with_same_logits(tmp_path):
    torch.manual_seed(0)
    ours = K3HybridForCausalLM(preset_config("tiny", **KIMI_LINEAR_FEATURES)).eval()
    ours.save_pretrained(tmp_path / "ours")
    export_kimi_linear(tmp_path / "ours", tmp_path / "kimi")

    assert json.loads((tmp_path / "kimi" / "config.json").read_text())["model_type"] == "kimi_linear"
    upstream, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "kimi", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    ids = random_ids(ours.config.vocab_size, batch=2, length=80)  # > one 64-token KDA chunk
    difference = (ours(ids).logits - upstream.eval()(ids).logits).abs().max()
    assert difference <= 1e-4


def test_export_refuses_k3_only_features_and_names_them(tmp_path):
    K3HybridForCausalLM(preset_config("tiny")).save_pretrained(tmp_path / "k3")
    with pytest.raises(ValueError) as err:
        export_kimi_linear(tmp_path / "k3", tmp_path / "out")
    message = str(err.value)
    for field in ("attn_res_block_size", "routed_expert_hidden_size", "mla_use_output_gate", "hidden_act"):
        assert field in message
    assert "linear_attn_config.use_full_rank_gate" in message
    assert not (tmp_path / "out").exists()


def test_export_names_the_file_when_it_is_not_a_k3_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json.*'llama'"):
        export_kimi_linear(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        export_kimi_linear(tmp_path / "missing", tmp_path / "out")


@torch.no_grad()
def test_save_and_load_round_trip_gives_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = K3HybridForCausalLM(preset_config("tiny")).eval()
    with torch.no_grad():
        for router in model.routers().values():
            router.e_score_correction_bias.uniform_(-0.1, 0.1)  # a trained bias must survive too
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, K3HybridForCausalLM)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    # same weights; the logits may differ in the last bit because BLAS picks kernels by memory alignment
    ids = random_ids(model.config.vocab_size, batch=2, length=20)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_auto_config_knows_k3_hybrid():
    fields = preset_config("tiny").to_dict()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert isinstance(config, K3HybridConfig)
    assert AutoModelForCausalLM.from_config(config).__class__ is K3HybridForCausalLM


def test_state_dict_uses_upstream_names():
    names = set(K3HybridForCausalLM(preset_config("tiny")).state_dict())
    expected = {
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.f_a_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
        "model.layers.1.self_attention_res_proj.weight",
        "model.layers.1.mlp_res_norm.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.self_attn.g_proj.weight",
        "model.output_attn_res_proj.weight",
    }
    assert expected <= names, sorted(expected - names)
