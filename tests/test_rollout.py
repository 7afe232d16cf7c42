"""The rollout interface on the HF backend (the baseline and fallback), and its Ray actor wrapper.

The vLLM backend's behaviour against HF is in test_vllm_plugin.py.
"""

from __future__ import annotations

import json

import pytest
import ray
import torch

from mopd.rollout import CheckpointError, PromptTooLongError, Sampling, create_engine
from mopd.rollout.checkpoint import write_random_checkpoint
from mopd.rollout.hf_backend import HFEngine
from mopd.rollout.ray_actor import RemoteEngine, from_object_store, rollout_actor, to_object_store

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_tiny")
    write_random_checkpoint(path, "tiny", seed=1)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    return HFEngine(checkpoint, max_model_len=MAX_MODEL_LEN)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens, **kwargs) -> Sampling:
    return Sampling(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_generate_n_samples_with_per_request_budgets(engine):
    prompts = prompts_of([6, 6, 11])  # two share a length and so a batch
    samples = engine.generate(prompts, n=3, sampling=Sampling(max_tokens=[2, 5, 4], ignore_eos=True, seed=0))
    assert [[len(s.token_ids) for s in group] for group in samples] == [[2] * 3, [5] * 3, [4] * 3]
    assert all(s.finish_reason == "length" and s.policy_version == 0 for group in samples for s in group)
    assert all(len(s.logprobs) == len(s.token_ids) and max(s.logprobs) <= 0 for group in samples for s in group)


def test_sampled_logprobs_equal_scoring_the_samples(engine):
    prompts = prompts_of([8, 13], seed=1)
    samples = engine.generate(prompts, n=2, sampling=Sampling(temperature=0.7, top_p=0.9, max_tokens=6, ignore_eos=True, seed=1))
    flat = [(p, s) for p, group in zip(prompts, samples, strict=True) for s in group]
    scores = engine.score([p for p, _ in flat], [s.token_ids for _, s in flat])
    for (_, sample), score in zip(flat, scores, strict=True):
        assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(score), atol=1e-4)


def test_stop_token_and_stop_string_end_a_sample(engine):
    prompt = prompts_of([10], seed=2)
    free_run = engine.generate(prompt, sampling=greedy(8, ignore_eos=True))[0][0].token_ids
    stop_id = free_run[3]
    by_token = engine.generate(prompt, sampling=greedy(8, stop_token_ids=[stop_id]))[0][0]
    first = free_run.index(stop_id)
    assert (by_token.token_ids, by_token.finish_reason) == (free_run[: first + 1], "stop")

    text_after = [engine.tokenizer.decode(free_run[: k + 1]) for k in range(len(free_run))]
    cut = next(k for k in range(1, len(free_run)) if text_after[k] != text_after[k - 1])
    stop_string = text_after[cut][len(text_after[cut - 1]) :]
    by_string = engine.generate(prompt, sampling=greedy(8, stop=[stop_string], ignore_eos=True))[0][0]
    assert by_string.finish_reason == "stop"
    assert stop_string in engine.tokenizer.decode(by_string.token_ids)
    assert by_string.token_ids == free_run[: len(by_string.token_ids)]


def test_update_weights_changes_the_policy_and_its_version(checkpoint):
    engine = HFEngine(checkpoint, max_model_len=MAX_MODEL_LEN)
    prompt, completion = prompts_of([9], seed=3), prompts_of([5], seed=4)
    before = engine.score(prompt, completion)[0]
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items() if v.is_floating_point()}
    assert engine.update_weights(state) == 1
    after = engine.score(prompt, completion)[0]
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
    assert engine.generate(prompt, n=2, sampling=greedy(2))[0][0].policy_version == 1
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.update_weights({"not_a_weight": torch.zeros(1)})


def test_bad_requests_are_named(engine):
    with pytest.raises(PromptTooLongError, match="request 2"):
        engine.generate(prompts_of([4, 4, MAX_MODEL_LEN]), sampling=greedy(4))
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        engine.generate(prompts_of([4, 4, 4]), sampling=greedy([1, 2]))
    with pytest.raises(ValueError, match="request 1"):
        engine.score(prompts_of([3, 3]), [[5], []])


def test_not_a_k3_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config"):
        create_engine(tmp_path, backend="hf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "k3_hybrid"}))
    with pytest.raises(CheckpointError, match="no weights"):
        create_engine(tmp_path, backend="hf")
    with pytest.raises(ValueError, match="unknown rollout backend"):
        create_engine(tmp_path, backend="sglang")


def test_ray_actor_serves_the_same_interface(checkpoint, engine):
    prompts = prompts_of([7, 12], seed=5)
    local_engine = create_engine(checkpoint, backend="hf", max_model_len=MAX_MODEL_LEN)
    torch.manual_seed(3)
    moved = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in local_engine.model.named_parameters()}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = rollout_actor(checkpoint, backend="hf", max_model_len=MAX_MODEL_LEN, num_cpus=2)
        assert ray.get(actor.describe.remote())["torch_threads"] == 2  # its CPUs, not the environment's OMP_NUM_THREADS
        remote = ray.get(actor.generate.remote(prompts, 1, greedy(4, ignore_eos=True)))
        assert ray.get(actor.update_weights.remote({})) == 1
        assert ray.get(actor.policy_version.remote()) == 1
        wrapped = RemoteEngine(actor)  # its push goes through the object store as numpy arrays
        assert wrapped.update_weights(moved) == 2
        remote_moved = wrapped.generate(prompts, sampling=greedy(4, ignore_eos=True))
    finally:
        ray.shutdown()
    local = engine.generate(prompts, sampling=greedy(4, ignore_eos=True))
    local_engine.update_weights(moved)
    local_moved = local_engine.generate(prompts, sampling=greedy(4, ignore_eos=True))
    for remote_, local_ in ((remote, local), (remote_moved, local_moved)):
        assert [g[0].token_ids for g in remote_] == [g[0].token_ids for g in local_]
        for r, loc in zip(remote_, local_, strict=True):
            assert r[0].logprobs == pytest.approx(loc[0].logprobs, abs=1e-5)
    assert [g[0].logprobs for g in remote_moved] != [g[0].logprobs for g in remote]  # the push reached the model


def test_weights_cross_the_object_store_as_numpy_bit_for_bit_and_bfloat16_as_tensors():
    weights = {"w": torch.randn(3, 4), "h": torch.randn(2, dtype=torch.float16), "b": torch.randn(5).bfloat16()}
    shipped = {name: to_object_store(t) for name, t in weights.items()}
    assert [type(v).__name__ for v in shipped.values()] == ["ndarray", "ndarray", "Tensor"]
    for name, tensor in weights.items():
        back = from_object_store(shipped[name])
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_one_task_scorer_answers_each_checkpoint_as_its_own_fresh_engine_would(tmp_path, tiny_tokenizer, monkeypatch):
    """Held-out scoring of several checkpoints (pair mode's before and after, the bench's models) through
    one engine, their weights swapped in: the rollouts of an engine and tokenizer per checkpoint."""
    from statistics import fmean

    from transformers import AutoTokenizer

    import mopd.rollout.engine_cache
    from mopd.envs import get_env
    from mopd.envs.effort import EffortSpec
    from mopd.model import K3HybridForCausalLM, preset_config
    from mopd.rollout.episodes import run_rollouts
    from mopd.rollout.held_out import TaskScorer, reward_summary, task_rewards
    from tests.fakes import seeded_copy

    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))).save_pretrained(tmp_path / "a")
    tiny_tokenizer.save_pretrained(tmp_path / "a")
    seeded_copy(tmp_path / "a", tmp_path / "b", seed=1)
    envs = {"general": get_env("general", families=["add"], add_digits=[1, 1])}
    tasks, efforts = envs["general"].sample(3, seed=0, split="dev", effort="low"), {"low": EffortSpec(budget_tokens=4, answer_tokens=4)}
    started = []
    monkeypatch.setattr(mopd.rollout.engine_cache, "create_engine", lambda *a, **k: started.append(a) or create_engine(*a, **k))

    order = ["a", "b", "b", "a"]
    with TaskScorer("hf", max_model_len=MAX_MODEL_LEN) as scorer:
        answered = [scorer.rollouts(tmp_path / name, envs, tasks, efforts, n=2, temperature=1.0, seed=7) for name in order]
    assert len(started) == 1 and scorer.engines.engine is None  # one engine, shut down on leaving

    def tokens(groups):
        return [[r.token_ids for r in group] for group in groups]

    for name, groups in zip(order, answered, strict=True):
        engine = HFEngine(tmp_path / name, max_model_len=MAX_MODEL_LEN)
        alone = run_rollouts(engine, AutoTokenizer.from_pretrained(tmp_path / name), envs, tasks, efforts, n=2, temperature=1.0, seed=7)
        assert tokens(groups) == tokens(alone), name
    assert tokens(answered[0]) != tokens(answered[1])  # b's weights answered, not a's

    groups = answered[0]
    assert task_rewards(groups) == [fmean(r.reward for r in group) for group in groups]
    summary = reward_summary(groups)
    assert summary["rollouts"] == 6 and summary["reward"] == pytest.approx(fmean(task_rewards(groups)))
