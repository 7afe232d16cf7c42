"""Teacher scoring: prefill-only log-probs of the student's exact tokens, locally and as Ray actors."""

import warnings
import weakref
from pathlib import Path

import pytest
import torch

from benchmarks.teacher_scoring_memory import materialised_score
from mopd.distill import scorer as scorer_module
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
    for s, expected, completion in zip(scores, reference, completions, strict=True):
        torch.testing.assert_close(s.logprobs, torch.tensor(expected), atol=1e-5, rtol=0)
        torch.testing.assert_close(s.full_logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), s.logprobs)
        assert torch.equal(s.topk_logprobs, s.full_logprobs.topk(3, dim=-1).values)
        assert s.full_logprobs.exp().sum(-1).sub(1).abs().max() < 1e-4  # temperature 1: a distribution
    assert scorer.tokens_scored == sum(len(c) for c in completions)


@pytest.fixture(scope="module")
def vocab_teachers(tmp_path_factory):
    """Tiny-shape teachers at the tiny vocabulary and at a larger one, without a tokenizer (ids only)."""
    root = tmp_path_factory.mktemp("vocab_teachers")
    for vocab in (1024, 32768):
        torch.manual_seed(vocab)
        K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=vocab)).save_pretrained(root / str(vocab))
    return {vocab: root / str(vocab) for vocab in (1024, 32768)}


@pytest.mark.parametrize("vocab", [1024, 32768])
def test_chunked_head_equals_the_materialised_log_softmax(vocab_teachers, vocab):
    # 3 positions per LM-head chunk and a 40-token batch budget: several chunks per sequence, padded batches
    scorer = TeacherScorer(vocab_teachers[vocab], max_batch_tokens=40, logits_chunk_bytes=3 * 4 * vocab)
    assert scorer.chunk_tokens == 3
    prompts, completions = requests(vocab, [(5, 7), (9, 3), (4, 12), (5, 1), (1, 8)], seed=vocab)
    got = scorer.score(prompts, completions, top_k=4, full=True)
    expected = materialised_score(scorer, prompts, completions, top_k=4, full=True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(g.topk_logprobs, e.topk_logprobs, atol=1e-5, rtol=0)
        assert torch.equal(g.topk_ids, e.topk_ids)
        torch.testing.assert_close(g.full_logprobs, e.full_logprobs, atol=1e-5, rtol=0)
    (alone,) = scorer.score(prompts[:1], completions[:1])  # no top-k, no full: the same sampled-token log-probs
    torch.testing.assert_close(alone.logprobs, got[0].logprobs, atol=1e-5, rtol=0)
    assert alone.topk_ids is None and alone.full_logprobs is None


def test_full_vocabulary_scores_warn_with_their_size(vocab_teachers, monkeypatch):
    scorer = TeacherScorer(vocab_teachers[1024])
    prompts, completions = requests(1024, [(3, 4), (2, 6)])
    monkeypatch.setattr(scorer_module, "FULL_VOCAB_WARN_BYTES", 4 * 10 * 1024 - 1)
    with pytest.warns(UserWarning, match=f"10 tokens x 1024 fp32 = {4 * 10 * 1024:,} bytes"):
        scorer.score(prompts, completions, full=True)
    monkeypatch.setattr(scorer_module, "FULL_VOCAB_WARN_BYTES", 4 * 10 * 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scorer.score(prompts, completions, full=True)


def test_requests_without_a_prompt_are_refused(vocab_teachers):
    scorer = TeacherScorer(vocab_teachers[1024])
    with pytest.raises(ValueError, match=r"requests \[1\] have an empty prompt"):
        scorer.score([[5], []], [[6], [7]])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        scorer.score([[5], [6]], [[7]])


def test_a_teacher_whose_logits_are_not_head_of_body_is_refused(vocab_teachers, monkeypatch):
    forward = K3HybridForCausalLM.forward

    def capped(self, *args, **kwargs):  # a soft-capped LM head, as some HF models have
        out = forward(self, *args, **kwargs)
        out.logits = 30 * torch.tanh(out.logits / 30)
        return out

    monkeypatch.setattr(K3HybridForCausalLM, "forward", capped)
    with pytest.raises(ValueError, match="logits are not its output embeddings applied to its decoder"):
        TeacherScorer(vocab_teachers[1024])


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
    for cell, prompt, completion, scores in zip(cells, prompts, completions, got, strict=True):
        owner = "b" if cell == "general-high" else "a"
        (expected,) = local[owner].score([prompt], [completion])
        torch.testing.assert_close(scores.logprobs, expected.logprobs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def four_teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_teachers")
    for seed in range(4):
        torch.manual_seed(100 + seed)
        K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=1024)).save_pretrained(root / str(seed))
    cells = ["general-low", "general-high", "code-low", "agent-max"]
    return build_route_table(dict.fromkeys(cells, 1.0), {cell: root / str(i) for i, cell in enumerate(cells)})


@pytest.mark.parametrize("cap", [1, 2])
def test_a_capped_pool_scores_exactly_as_all_resident_loading_each_teacher_once_a_step(four_teachers, cap, monkeypatch):
    from transformers import AutoModelForCausalLM

    table = four_teachers
    cells = list(table.routes)
    steps = [  # interleaved cells: a pool that followed sample order would reload teachers within a step
        [cells[i] for i in (0, 1, 2, 3, 0, 2, 1, 3, 0)],
        [cells[i] for i in (3, 1, 0, 3, 1, 0)],  # the last step's resident teachers first, then the others
    ]
    requested = [requests(1024, [(3 + i % 4, 2 + i % 5) for i in range(len(s))], seed=k) for k, s in enumerate(steps)]
    uncapped = TeacherPool(table, use_ray=False)
    expected = [uncapped.score(s, *r, top_k=2, full=True) for s, r in zip(steps, requested, strict=True)]

    loads, live, resident_while_scoring = [], weakref.WeakSet(), []
    from_pretrained, score = AutoModelForCausalLM.from_pretrained, TeacherScorer.score

    def counting_load(checkpoint, **kwargs):
        model = from_pretrained(checkpoint, **kwargs)
        loads.append(str(checkpoint))
        live.add(model)
        return model

    def counting_score(self, *args, **kwargs):  # no gc.collect(): an evicted teacher must be freed at once
        resident_while_scoring.append(len(live))
        return score(self, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting_load)
    monkeypatch.setattr(TeacherScorer, "score", counting_score)
    pool = TeacherPool(table, use_ray=False, max_resident=cap)
    assert len(loads) == cap
    for step, (step_cells, (prompts, completions)) in enumerate(zip(steps, requested, strict=True)):
        resident_before, loads_before = list(pool.resident), len(loads)
        got = pool.score(step_cells, prompts, completions, top_k=2, full=True)
        for g, e in zip(got, expected[step], strict=True):
            assert torch.equal(g.logprobs, e.logprobs) and torch.equal(g.full_logprobs, e.full_logprobs)
            assert torch.equal(g.topk_ids, e.topk_ids) and torch.equal(g.topk_logprobs, e.topk_logprobs)
        step_loads = loads[loads_before:]
        assert len(step_loads) == len(set(step_loads))  # each teacher loaded at most once a step
        needed = {str(table.teacher_for(c)) for c in step_cells}
        assert set(step_loads) == needed - {str(p) for p in resident_before}  # resident teachers were not reloaded
    assert max(resident_while_scoring) == cap  # never more than `cap` modules alive
    assert pool.loads == len(loads) - cap


def test_a_pool_refuses_a_cap_below_one_and_an_offloaded_scorer_refuses_to_score(four_teachers):
    with pytest.raises(ValueError, match="max_resident teachers must be at least 1, got 0"):
        TeacherPool(four_teachers, use_ray=False, max_resident=0)
    scorer = TeacherScorer(next(iter(four_teachers.teachers)), load=False)
    with pytest.raises(RuntimeError, match="is offloaded: load"):
        scorer.score([[5]], [[6]])
    scorer.load()
    (first,) = scorer.score([[5, 7]], [[6, 8]])
    scorer.offload()
    assert scorer.model is None and not scorer.resident  # on CPU the module is dropped, re-read on load
    scorer.load()
    assert torch.equal(scorer.score([[5, 7]], [[6, 8]])[0].logprobs, first.logprobs)


def test_the_trainer_scores_with_at_most_max_resident_teachers_loaded(tmp_path, tiny_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    from mopd.distill.trainer import train_mopd
    from mopd.envs.effort import EffortSpec
    from mopd.recipe import DistillSpec
    from tests.fakes import seeded_copy

    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))).save_pretrained(tmp_path / "s")
    tiny_tokenizer.save_pretrained(tmp_path / "s")
    cells = ["general-low", "general-high", "general-max"]
    teachers = {cell: seeded_copy(tmp_path / "s", tmp_path / cell, seed=i + 1) for i, cell in enumerate(cells)}
    loaded, from_pretrained = [], AutoModelForCausalLM.from_pretrained

    def track(checkpoint, **kwargs):
        model = from_pretrained(checkpoint, **kwargs)
        if Path(checkpoint) in {path.resolve() for path in teachers.values()}:
            loaded.append(weakref.ref(model))
        return model

    def resident_teachers() -> int:
        return sum(ref() is not None for ref in loaded)

    score, resident_while_scoring = TeacherScorer.score, []

    def counting_score(self, *args, **kwargs):
        resident_while_scoring.append(resident_teachers())
        return score(self, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", track)
    monkeypatch.setattr(TeacherScorer, "score", counting_score)
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), steps=1, prompts_per_step=6, teacher_actors=False, max_resident_teachers=1)
    short = {e: EffortSpec(budget_tokens=4, answer_tokens=4) for e in ("low", "high", "max")}
    easy = {"general": {"families": ["add"], "add_digits": [1, 1]}}
    train_mopd(tmp_path / "s", teachers, spec, tmp_path / "out", efforts=short, env_options=easy, backend="hf", progress=False)
    assert len(resident_while_scoring) == 3 and max(resident_while_scoring) == 1  # three teachers, one loaded at a time
    assert len(loaded) == 3
