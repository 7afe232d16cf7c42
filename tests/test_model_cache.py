"""Generation cache: incremental decode equals a full forward; KDA state is constant, the MLA latent grows exactly."""

import pytest
import torch

from mopd.model import K3HybridForCausalLM, preset_config
from mopd.model.cache import K3HybridCache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = preset_config(
        "tiny"
    )  # every K3 feature on: AttnRes, LatentMoE, gated MLA, q_lora, SiTU, K3 gate
    return K3HybridForCausalLM(config).eval()


def random_ids(model, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)


@torch.no_grad()
def test_incremental_decode_matches_full_forward(model):
    ids = random_ids(model, batch=2, length=84, seed=1)
    full = model(ids, use_cache=False).logits

    cache = K3HybridCache(model.config)
    pieces = [model(ids[:, :70], past_key_values=cache, use_cache=True).logits]  # prefill beyond one chunk
    pieces.append(model(ids[:, 70:75], past_key_values=cache, use_cache=True).logits)  # multi-token continue
    for t in range(75, 84):
        pieces.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    incremental = torch.cat(pieces, dim=1)

    assert (incremental - full).abs().max() <= 1e-4


@torch.no_grad()
def test_kda_state_bytes_do_not_depend_on_length(model):
    sizes = {}
    for length in (64, 4096):
        cache = K3HybridCache(model.config)
        model(random_ids(model, batch=1, length=length, seed=2), past_key_values=cache, use_cache=True)
        sizes[length] = cache.kda_state_bytes()
    assert sizes[64] > 0
    assert sizes[64] == sizes[4096]


@torch.no_grad()
def test_mla_cache_grows_by_latent_plus_rope_per_token_per_layer(model):
    config = model.config
    per_token = config.kv_lora_rank + config.qk_rope_head_dim
    mla_layers = config.layer_types.count("full_attention")
    batch, prompt = 2, 10
    cache = K3HybridCache(config)
    model(random_ids(model, batch, prompt, seed=3), past_key_values=cache, use_cache=True)
    assert cache.mla_cache_numel() == batch * prompt * mla_layers * per_token
    before, kda_before = cache.mla_cache_numel(), cache.kda_state_bytes()
    model(random_ids(model, batch, 1, seed=4), past_key_values=cache, use_cache=True)
    assert cache.mla_cache_numel() - before == batch * mla_layers * per_token
    assert cache.kda_state_bytes() == kda_before
    assert cache.get_seq_length() == prompt + 1


@torch.no_grad()
def test_greedy_generate_equals_argmax_over_full_forwards(model):
    prompt = random_ids(model, batch=2, length=12, seed=5)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt
    for _ in range(6):
        next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=1)
    assert torch.equal(generated, ids)


@torch.no_grad()
def test_sampling_with_cache_equals_sampling_without(model):
    prompt = random_ids(model, batch=2, length=12, seed=6)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(
            model.generate(
                prompt,
                max_new_tokens=6,
                do_sample=True,
                top_k=0,
                temperature=1.0,
                use_cache=use_cache,
                eos_token_id=None,
                pad_token_id=0,
            )
        )
    assert runs[0].shape == (2, 18)
    assert torch.equal(runs[0], runs[1])


@torch.no_grad()
def test_left_padded_batch_generates_what_each_prompt_generates_alone(model):
    prompts = [random_ids(model, 1, length, seed=10 + length)[0] for length in (5, 11, 8)]
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id
    input_ids = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    attention_mask = torch.stack(
        [torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]
    )

    batched = model.generate(
        input_ids,
        attention_mask=attention_mask.long(),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
    )
    for row, prompt in enumerate(prompts):
        alone = model.generate(
            prompt[None], max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        assert torch.equal(batched[row, width:], alone[0, len(prompt) :]), (
            f"prompt {row} (length {len(prompt)})"
        )
