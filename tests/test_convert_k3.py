"""`mopd init-student --arch k3 --init convert`: a K3 hybrid converted from a small Llama built here
(random weights, GQA, head dim 64): copied tensors equal, MLA keys/values are the teacher's, the
converted model is closer to the teacher than a random-init K3, and it loads in transformers and vLLM."""

from __future__ import annotations

import json

import pytest
import torch

from mopd.cli import main
from mopd.convert import init_student

LAYERS = 5  # KDA, KDA, KDA, MLA, MLA (every 4th and the last)
BATCH = (2, 48)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        initializer_range=0.08, rope_theta=10000.0, max_position_embeddings=512,
        pad_token_id=tiny_tokenizer.pad_token_id, bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so copying them is checked
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def converted(teacher, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = init_student(teacher[0], tmp_path_factory.mktemp("k3") / "converted", arch="k3", preset="tiny", init="convert")
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, BATCH, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def mean_kl(teacher, student, ids) -> float:
    """Mean next-token KL(teacher || student) over the batch's positions."""
    p = teacher(input_ids=ids).logits.float().log_softmax(-1)
    q = student(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_converted_config_and_record(converted):
    path, model = converted
    config = model.config
    assert config.model_type == "k3_hybrid" and config.num_hidden_layers == LAYERS
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] * 2
    assert config.mlp_layer_types == ["dense"] * LAYERS and config.hidden_act == "silu"
    assert config.attn_res_block_size is None and config.q_lora_rank is None
    assert config.linear_attn_config["num_heads"] == 4 and config.linear_attn_config["head_dim"] == 64
    made = json.loads((path / "init_student.json").read_text())
    assert made["init"] == "convert" and made["kept_layers"] == list(range(LAYERS))
    assert made["mla_layers"] == [3, 4] and made["kv_lora_rank"] == 128  # min(2 kv heads * 64 * 2, hidden 128)
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def test_copied_tensors_equal(teacher, converted):
    source, student = teacher[1], converted[1]
    assert torch.equal(student.get_input_embeddings().weight, source.get_input_embeddings().weight)
    assert torch.equal(student.lm_head.weight, source.lm_head.weight)  # tied
    assert torch.equal(student.model.norm.weight, source.model.norm.weight)
    for ours, theirs in zip(student.model.layers, source.model.layers, strict=True):
        assert torch.equal(ours.input_layernorm.weight, theirs.input_layernorm.weight)
        assert torch.equal(ours.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(ours.mlp, name).weight, getattr(theirs.mlp, name).weight)
        x = torch.randn(3, 7, 128)
        torch.testing.assert_close(ours.mlp(x), theirs.mlp(x))  # silu: the dense MLP computes the teacher's
        if ours.is_kda:
            assert torch.equal(ours.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
            k_heads = theirs.self_attn.k_proj.weight.view(2, 64, 128)
            assert torch.equal(ours.self_attn.k_proj.weight.view(4, 64, 128)[1], k_heads[0])  # GQA repeated
            assert torch.equal(ours.self_attn.k_proj.weight.view(4, 64, 128)[2], k_heads[1])


@torch.no_grad()
def test_mla_keys_and_values_are_the_teachers_up_to_the_latent_norm(teacher, converted):
    source, student = teacher[1], converted[1]
    mla, attention = student.model.layers[3].self_attn, source.model.layers[3].self_attn
    x = torch.randn(1, 9, 128)
    latent, k_rope = mla.compress_kv(x)
    key, value = mla.expand_kv(latent, k_rope)  # [1, H, T, 64]
    # undo the latent RMSNorm's per-token factor: it maps down(x) to down(x) * gamma / rms(down(x))
    down = mla.kv_a_proj_with_mqa(x)
    factor = (down.square().mean(-1).add(1e-6).sqrt() / mla.kv_a_layernorm.weight[0])[0, None, :, None]
    want_k = attention.k_proj(x).view(1, 9, 2, 64).transpose(1, 2).repeat_interleave(2, dim=1)
    want_v = attention.v_proj(x).view(1, 9, 2, 64).transpose(1, 2).repeat_interleave(2, dim=1)
    torch.testing.assert_close(key * factor, want_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(value * factor, want_v, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mla.project_query(x), attention.q_proj(x).view(1, 9, 4, 64).transpose(1, 2))


def test_converted_is_closer_to_the_teacher_than_a_random_k3(teacher, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    random_dir = init_student(teacher[0], tmp_path / "random", arch="k3", preset="tiny", init="random", layers=LAYERS)
    random_k3 = AutoModelForCausalLM.from_pretrained(random_dir, dtype=torch.float32).eval()
    source, student = teacher[1], converted[1]
    ids = batch(source.config.vocab_size)
    with torch.no_grad():
        assert torch.isfinite(student(input_ids=ids, use_cache=False).logits).all()
    ours, theirs = mean_kl(source, student, ids), mean_kl(source, random_k3, ids)
    assert ours < 0.5 * theirs, (ours, theirs)


def test_cli_converts_a_layer_subset(teacher, tmp_path):
    out = tmp_path / "k3"
    argv = ["init-student", "--from", str(teacher[0]), "--out", str(out), "--arch", "k3", "--init", "convert",
            "--preset", "tiny", "--layers", "3"]  # fmt: skip
    assert main(argv) == 0
    made = json.loads((out / "init_student.json").read_text())
    assert made["kept_layers"] == [0, 2, 4] and made["layers"] == 3 and made["mla_layers"] == [2]


def test_vllm_scores_the_converted_checkpoint(converted, monkeypatch):
    from mopd.rollout.engine import create_engine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path, model = converted
    ids = batch(model.config.vocab_size)[0].tolist()
    engine = create_engine(path, backend="vllm", max_model_len=256, max_num_seqs=4)
    try:
        got = torch.tensor(engine.score([ids[:8]], [ids[8:]])[0])
    finally:
        engine.close()
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    want = logprobs[7:-1].gather(-1, torch.tensor(ids[8:])[:, None]).squeeze(-1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)  # fp32 both sides: summation order only (as tests/test_vllm_plugin.py)


# ----------------------------------------------------------------------------- attention transfer
TRANSFER_STEPS, TRANSFER_PROMPTS = 24, 8


@pytest.fixture(scope="module")
def transferred(teacher, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("k3") / "transferred"
    argv = ["init-student", "--from", str(teacher[0]), "--out", str(out), "--arch", "k3", "--init", "convert",
            "--preset", "tiny", "--transfer-steps", str(TRANSFER_STEPS), "--transfer-prompts", str(TRANSFER_PROMPTS),
            "--transfer-lr", "1e-3"]  # fmt: skip
    assert main(argv) == 0
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_attention_transfer_lowers_every_layers_mse_and_is_recorded(transferred):
    record = json.loads((transferred[0] / "init_student.json").read_text())["attention_transfer"]
    assert record["steps"] == TRANSFER_STEPS and record["prompts"] == TRANSFER_PROMPTS and record["lr"] == 1e-3
    assert record["split"] == "train" and record["domain"] == "general" and record["tokens"] > 0
    before, after = record["mse_before"], record["mse_after"]
    assert len(before) == len(after) == LAYERS
    assert all(a < b for a, b in zip(after, before, strict=True)) and record["reverted_layers"] == [], (before, after)
    assert sum(after) < 0.7 * sum(before), (before, after)


def test_attention_transfer_changes_only_the_mixers(converted, transferred):
    plain, trained = converted[1].state_dict(), transferred[1].state_dict()
    assert plain.keys() == trained.keys()
    mixers = [name for name in plain if ".self_attn." in name]
    for name, tensor in plain.items():
        if name not in mixers:  # embeddings, norms, MLPs: the teacher's, byte for byte
            assert torch.equal(tensor, trained[name]), name
    changed = {name.split(".self_attn.")[0] for name in mixers if not torch.equal(plain[name], trained[name])}
    assert changed == {f"model.layers.{i}" for i in range(LAYERS)}  # every layer's mixer trained


def test_transfer_steps_0_is_the_plain_conversion(teacher, converted, tmp_path):
    out = tmp_path / "k3"
    argv = ["init-student", "--from", str(teacher[0]), "--out", str(out), "--arch", "k3", "--init", "convert",
            "--preset", "tiny", "--transfer-steps", "0"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "init_student.json").read_text()) == json.loads((converted[0] / "init_student.json").read_text())
    assert (out / "model.safetensors").read_bytes() == (converted[0] / "model.safetensors").read_bytes()


def test_attention_transfer_needs_a_converted_k3(teacher, tmp_path):
    from mopd.convert import StudentInitError

    with pytest.raises(StudentInitError, match="--arch k3 --init convert"):
        init_student(teacher[0], tmp_path / "same", arch="same", layers=2, transfer_steps=5)
