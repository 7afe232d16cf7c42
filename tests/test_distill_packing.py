"""Packing (issue #58 item 3): the student's step and the HF teacher's scores on packed rows equal the padded ones."""

import pytest
import torch

from mopd.distill.packing import PackingError, packed_rows
from mopd.distill.scorer import TeacherScorer, packed_batches
from mopd.distill.student import Student, collate, packed_collate, token_micro_batches
from mopd.envs.base import Task
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout
from tests.fakes import build_llama

CELLS = ["general-low", "general-high"]
LENGTHS = [(6, 3), (30, 40), (4, 8), (9, 5), (25, 2), (5, 30)]  # (prompt, completion) tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("packing")
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))).save_pretrained(root / "k3")
    tiny_tokenizer.save_pretrained(root / "k3")
    return {
        "student": build_llama(root / "student", tiny_tokenizer, seed=0),
        "teacher": build_llama(root / "teacher", tiny_tokenizer, seed=1),
        "k3": root / "k3",
    }


@pytest.fixture(scope="module")
def rollouts():
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (p, c) in enumerate(LENGTHS):
        r = Rollout(Task(f"t{i}", "general", CELLS[i % 2].split("-")[1], "q"), torch.randint(3, 100, (p,), generator=gen).tolist())
        r.token_ids = torch.randint(3, 100, (c,), generator=gen).tolist()
        r.logprobs = (-torch.rand(c, generator=gen)).tolist()
        r.loss_mask = [int(x) for x in torch.rand(c, generator=gen) < 0.8]
        r.reward = float(i % 3 == 0)
        out.append(r)
    return out


def spec(**fields):
    return DistillSpec(mix=dict.fromkeys(CELLS, 1.0), teacher_actors=False, learning_rate=1e-3, **fields)


@pytest.mark.parametrize("name", ["student", "k3"])
def test_the_head_runs_over_completion_columns_only_and_gives_the_full_forwards_logits(models, rollouts, name):
    from transformers import AutoModelForCausalLM

    import mopd.model  # noqa: F401  (registers the K3 hybrid)

    model = AutoModelForCausalLM.from_pretrained(models[name]).eval()
    scores = TeacherScorer(models["teacher"]).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    batch = collate(rollouts, scores, pad_id=0)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    with torch.no_grad():
        trimmed = Student.completion_logits(model, batch)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    expected = full.gather(1, batch.positions[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(trimmed, expected)  # fp32's tolerance: a GEMM of another shape may sum in another order
    # from the shortest prompt's last token to the one before the longest sequence's end
    first, width = min(len(r.prompt_ids) for r in rollouts) - 1, batch.input_ids.shape[1]
    assert calls == [width - 1 - first, width]


def test_packed_rows_fill_the_longest_width_longest_first_restarting_positions():
    input_ids, position_ids, starts = packed_rows([[5, 6], [7, 8, 9, 10], [11], [12, 13, 14]], pad_id=0)
    assert input_ids.tolist() == [[7, 8, 9, 10], [12, 13, 14, 11], [5, 6, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]  # the padding is a segment of its own
    assert starts == [8, 0, 7, 4]  # in the flattened rows


def test_micro_batches_of_packed_rows_are_cut_by_real_tokens(rollouts):
    runs = token_micro_batches(rollouts, 64)  # lengths 9, 70, 12, 14, 27, 35
    assert runs == [[0], [1], [2, 3, 4], [5]]
    assert token_micro_batches(rollouts, None) == [list(range(len(rollouts)))]
    assert packed_batches([r.prompt_ids + r.token_ids for r in rollouts], 64) == runs


def test_the_packed_batch_gives_the_padded_logits_on_every_completion_token(models, rollouts):
    student = Student.load(models["student"], spec(packing=True), reference_dir=models["student"])
    scores = TeacherScorer(models["teacher"]).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    padded, packed = collate(rollouts, scores, pad_id=0), packed_collate(rollouts, scores)
    assert packed.input_ids.shape == (3, 70) and padded.input_ids.shape == (6, 70)  # 9+12+14, 27+35, 70
    with torch.no_grad():
        logits = [Student.completion_logits(student.model, batch) for batch in (padded, packed)]
    torch.testing.assert_close(logits[1] * padded.mask[..., None], logits[0] * padded.mask[..., None], atol=1e-5, rtol=1e-5)
    for name in ("tokens", "mask", "rollout_logprobs", "teacher_logprobs"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name


@pytest.mark.parametrize(
    "options",
    [
        {"full_vocab_kl": False, "orm_alpha": 0.5},
        {"full_vocab_kl": True, "micro_batch_tokens": 64, "balance_tokens": True},
        {"full_vocab_kl": False, "reward_scale": 1.5, "micro_batch_tokens": 64},  # ExOPD: the reference forward packs too
    ],
)
def test_a_packed_train_step_has_the_padded_loss_and_gradients(models, rollouts, options):
    cells = [CELLS[i % 2] for i in range(len(rollouts))]
    scores = TeacherScorer(models["teacher"]).score(
        [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=options["full_vocab_kl"]
    )
    # no IcePop mask: these made-up rollout log-probs are far from the student's, it would zero every token
    options = {"importance": {"mode": "none"}, **options}
    padded = Student.load(models["student"], spec(**options), reference_dir=models["student"])
    packed = Student.load(models["student"], spec(packing=True, **options), reference_dir=models["student"])
    metrics = [student.train_step(rollouts, scores, cells) for student in (padded, packed)]
    for a, b in zip(padded.model.parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4)
    for name in ("loss", "reverse_kl", "grad_norm", "train_rollout_gap", "general-low/reverse_kl", "general-high/tokens"):
        assert metrics[1][name] == pytest.approx(metrics[0][name], rel=1e-5, abs=1e-6), name


def test_packed_teacher_scores_equal_padded_ones(models, rollouts):
    prompts, completions = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
    padded = TeacherScorer(models["teacher"], max_batch_tokens=64).score(prompts, completions, top_k=3, full=True)
    packed = TeacherScorer(models["teacher"], max_batch_tokens=64, packing=True).score(prompts, completions, top_k=3, full=True)
    for a, b in zip(padded, packed, strict=True):
        for name in ("logprobs", "topk_logprobs", "full_logprobs"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-5, rtol=1e-5)
        assert torch.equal(b.topk_ids, a.topk_ids)


def test_the_k3_hybrid_refuses_packing_at_load(models):
    # its KDA layers carry recurrent and convolution state across the boundary of packed sequences
    with pytest.raises(PackingError, match=r"distill\.packing: the student \(K3HybridForCausalLM\)"):
        Student.load(models["k3"], spec(packing=True), reference_dir=models["k3"])
    with pytest.raises(PackingError, match="does not keep packed sequences apart"):
        TeacherScorer(models["k3"], packing=True)


def test_packing_needs_one_trainer_process():
    with pytest.raises(ValueError, match="packing: true trains in one process"):
        spec(packing=True, trainer_workers=2)


@pytest.mark.parametrize(
    "options", [{}, {"orm_alpha": 0.5}, {"reward_scale": 1.5}, {"packing": True, "orm_alpha": 0.5}, {"balance_tokens": True}]
)
def test_the_fused_full_vocabulary_loss_has_the_whole_tensor_loss_log_probs_and_gradients(models, rollouts, options):
    """Only the trained positions reach the vocabulary-wide work now; the loss, the trainer's log-probs on trained
    tokens and every parameter's gradient are those of the whole-tensor computation, to fp32's tolerance."""
    from benchmarks.distill_items import whole_tensor_full_vocab_loss
    from mopd.distill.student import orm_advantages, token_weights

    cells = [CELLS[i % 2] for i in range(len(rollouts))]
    scores = TeacherScorer(models["teacher"]).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=True)
    student = Student.load(models["student"], spec(full_vocab_kl=True, importance={"mode": "none"}, **options), reference_dir=models["student"])
    batch = (packed_collate if student.spec.packing else collate)(rollouts, scores, 0)
    orm = orm_advantages(rollouts, cells)
    weights = batch.mask * token_weights(rollouts, cells, student.spec.balance_tokens)[:, None]
    results = []
    for compute in (student.micro_batch_loss, None):
        student.model.zero_grad()
        if compute is None:
            loss, train = whole_tensor_full_vocab_loss(student, batch, scores, orm, weights)
        else:
            loss, train = compute(batch, scores, orm, token_weights(rollouts, cells, student.spec.balance_tokens))
        loss.backward()
        results.append((loss.detach(), train.detach() * batch.mask, [p.grad.clone() for p in student.model.parameters()]))
    (fused_loss, fused_train, fused_grads), (loss, train, grads) = results
    torch.testing.assert_close(fused_loss, loss)
    torch.testing.assert_close(fused_train, train)
    for fused, whole in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(fused, whole)
