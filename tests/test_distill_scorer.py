"""Teacher scoring: prefill-only log-probs of the student's exact tokens, locally and as Ray actors."""

import pytest
import torch

from mopd.distill.routing import build_route_table
from mopd.distill.scorer import TeacherPool, TeacherScorer, token_budget_batches
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.rollout.engine import create_engine


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("teachers")
    tokenizer = tiny_tokenizer
    paths = {}
    for seed, name in enumerate(["a", "b"]):
        torch.manual_seed(seed)
        K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tokenizer))).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def requests(vocab, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    completions = [torch.randint(3, vocab, (c,), generator=gen).tolist() for _, c in lengths]
    return prompts, completions


def test_scores_are_the_log_probs_of_the_exact_sampled_tokens(teachers):
    scorer = TeacherScorer(teachers["a"], max_batch_tokens=40)  # forces several padded batches
    prompts, completions = requests(scorer.model.config.vocab_size, [(5, 7), (9, 3), (4, 12), (5, 1)])
    scores = scorer.score(prompts, completions, top_k=3, full=True)

    reference = create_engine(teachers["a"], backend="hf").score(prompts, completions)  # one sequence at a time
    for s, expected, completion in zip(scores, reference, completions):
        torch.testing.assert_close(s.logprobs, torch.tensor(expected), atol=1e-5, rtol=0)
        torch.testing.assert_close(s.full_logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), s.logprobs)
        assert torch.equal(s.topk_logprobs, s.full_logprobs.topk(3, dim=-1).values)
        assert s.full_logprobs.exp().sum(-1).sub(1).abs().max() < 1e-4  # temperature 1: a distribution
    assert scorer.tokens_scored == sum(len(c) for c in completions)


def test_batches_respect_the_token_budget():
    sequences = [[0] * n for n in (3, 10, 4, 9, 2)]
    batches = token_budget_batches(sequences, 20)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert all(len(b) * max(len(sequences[i]) for i in b) <= 20 or len(b) == 1 for b in batches)


def test_ray_actor_pool_routes_each_sample_to_its_teacher(teachers):
    import ray

    table = build_route_table(
        {"general-low": 1.0, "general-high": 1.0, "agent-low": 1.0},
        {"general-low": teachers["a"], "general-high": teachers["b"], "agent-low": teachers["a"]},
    )
    local = {name: TeacherScorer(path) for name, path in teachers.items()}
    pool = TeacherPool(table, use_ray=True, num_cpus=0)
    try:
        assert len(pool.scorers) == 2  # aliases of one checkpoint share one actor
        cells = ["general-high", "general-low", "agent-low", "general-high"]
        prompts, completions = requests(local["a"].model.config.vocab_size, [(4, 5), (6, 3), (3, 4), (5, 6)], seed=1)
        got = pool.score(cells, prompts, completions)
    finally:
        pool.close()
        ray.shutdown()
    for cell, prompt, completion, scores in zip(cells, prompts, completions, got):
        owner = "b" if cell == "general-high" else "a"
        (expected,) = local[owner].score([prompt], [completion])
        torch.testing.assert_close(scores.logprobs, expected.logprobs, atol=1e-5, rtol=0)
