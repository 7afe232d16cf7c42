"""Teacher scoring in vLLM (issue #58 item 1): the engine's prefill scores equal the HF scorer's on the same tokens.

One vLLM teacher engine serves the module (an engine start dominates the cost): a stock llama, the kind of
teacher stock vLLM serves (the K3 plugin's own prefill parity is in test_vllm_plugin.py).
"""

import pytest
import torch

from mopd.distill.routing import build_route_table
from mopd.distill.scorer import TeacherPool, TeacherScorer, VllmTeacherScorer
from mopd.recipe import DistillSpec, RecipeError, validate
from tests.fakes import build_llama

TOL = 1e-3  # fp32, as the plugin's parity tests (tests/test_vllm_plugin.py)
CELLS = ["general-low", "general-high"]
LENGTHS = [(5, 7), (40, 3), (4, 60), (9, 1)]  # (prompt, completion) tokens


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_tokenizer):
    return build_llama(tmp_path_factory.mktemp("vllm_teacher") / "teacher", tiny_tokenizer, seed=1)


@pytest.fixture(scope="module")
def pool(teacher):
    table = build_route_table(dict.fromkeys(CELLS, 1.0), dict.fromkeys(CELLS, str(teacher)))
    pool = TeacherPool(table, use_ray=False, scoring="vllm", max_model_len=256)
    yield pool
    pool.close()


def requests(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (p,), generator=gen).tolist() for p, _ in lengths]
    return prompts, [torch.randint(3, 500, (c,), generator=gen).tolist() for _, c in lengths]


def test_vllm_scores_equal_hf_scores_on_the_same_tokens(pool, teacher):
    prompts, completions = requests(LENGTHS)
    cells = [CELLS[i % 2] for i in range(len(prompts))]
    served = pool.score(cells, prompts, completions, top_k=4)
    reference = TeacherScorer(teacher).score(prompts, completions, top_k=4)
    assert [len(s.logprobs) for s in served] == [c for _, c in LENGTHS]
    for vllm, hf in zip(served, reference, strict=True):
        assert vllm.logprobs.dtype == hf.logprobs.dtype == torch.float32
        assert (vllm.logprobs - hf.logprobs).abs().max() < TOL
        assert (vllm.topk_logprobs - hf.topk_logprobs).abs().max() < TOL
        assert torch.equal(vllm.topk_ids, hf.topk_ids)
        assert vllm.full_logprobs is None
    (scorer,) = pool.scorers.values()  # both cells share the one teacher, and so its one engine
    assert isinstance(scorer, VllmTeacherScorer) and scorer.tokens_scored == sum(c for _, c in LENGTHS)


def test_vllm_scoring_has_no_full_vocabulary(pool):
    prompts, completions = requests(LENGTHS[:1])
    with pytest.raises(ValueError, match=r"no full-vocabulary distribution \(distill\.scoring: hf does\)"):
        pool.score(CELLS[:1], prompts, completions, full=True)


def test_the_exact_kl_refuses_vllm_scoring_naming_both_fields():
    with pytest.raises(RecipeError, match=r"scoring: vllm needs full_vocab_kl: false"):
        validate(DistillSpec, {"scoring": "vllm"}, source="test")  # full_vocab_kl defaults to true
    assert DistillSpec(scoring="vllm", full_vocab_kl=False).scoring == "vllm"
    assert "scoring" not in DistillSpec().model_dump(exclude_defaults=True)  # the default leaves stage hashes as they were
