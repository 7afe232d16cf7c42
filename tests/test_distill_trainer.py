"""The MOPD loop: routed scoring, recomputed log-probs, weight sync, staleness, metrics, checkpoints, resume."""

import json
from pathlib import Path

import pytest
import torch

from mopd.distill.routing import RoutingError
from mopd.distill.scorer import TeacherScorer
from mopd.distill.student import (
    Student,
    collate,
    length_sorted_micro_batches,
    orm_advantages,
    scheduled_learning_rate,
)
from mopd.distill.trainer import StalenessError, check_staleness, train_mopd
from mopd.envs.base import Task
from mopd.envs.effort import EffortSpec
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout
from tests.fakes import seeded_copy

CELLS = ["general-low", "general-high"]
SHORT = {e: EffortSpec(budget_tokens=4, answer_tokens=4) for e in ("low", "high", "max")}
EASY = {"general": {"families": ["add"], "add_digits": [1, 1]}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("mopd")
    tokenizer = tiny_tokenizer
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tokenizer))).save_pretrained(root / "student")
    tokenizer.save_pretrained(root / "student")
    teachers = {cell: seeded_copy(root / "student", root / cell, seed=i + 1) for i, cell in enumerate(CELLS)}
    return root, root / "student", teachers


def spec(**fields):
    return DistillSpec(mix=dict.fromkeys(CELLS, 1.0), prompts_per_step=4, teacher_actors=False, learning_rate=1e-3, **fields)


def run(setup, out, **fields):
    root, student, teachers = setup
    return train_mopd(student, teachers, spec(**fields), root / out, efforts=SHORT, env_options=EASY, backend="hf", progress=False)


def test_the_trainer_recomputes_exactly_what_the_teacher_scores(setup):
    _, student_dir, _ = setup
    student = Student.load(student_dir, spec(), reference_dir=student_dir)
    gen = torch.Generator().manual_seed(0)
    rollouts = []
    for p, c in [(6, 3), (4, 8), (9, 5)]:
        r = Rollout(Task("t", "general", "low", "q"), torch.randint(3, 100, (p,), generator=gen).tolist())
        r.token_ids = torch.randint(3, 100, (c,), generator=gen).tolist()
        r.logprobs, r.loss_mask = [0.0] * c, [1] * c
        rollouts.append(r)
    scores = TeacherScorer(student_dir).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    batch = collate(rollouts, scores, pad_id=0)
    with torch.no_grad():
        logits = Student.completion_logits(student.model.eval(), batch)
    train = torch.log_softmax(logits, -1).gather(-1, batch.tokens[..., None]).squeeze(-1)
    # same weights: the trainer's padded batch gives the teacher's per-sequence log-probs on every real token
    torch.testing.assert_close(train * batch.mask, batch.teacher_logprobs, atol=1e-5, rtol=0)
    assert batch.mask.sum(1).tolist() == [3, 8, 5]


@pytest.mark.parametrize(("full_vocab_kl", "balance_tokens"), [(False, False), (True, False), (False, True), (True, True)])
def test_length_sorted_micro_batches_give_the_whole_batch_gradient(setup, full_vocab_kl, balance_tokens):
    _, student_dir, teachers = setup
    gen = torch.Generator().manual_seed(1)
    rollouts, cells = [], []
    for i, (p, c) in enumerate([(6, 3), (30, 40), (4, 8), (9, 5), (25, 2), (5, 30)]):
        cell = CELLS[i % 2]
        r = Rollout(Task(f"t{i}", "general", cell.split("-")[1], "q"), torch.randint(3, 100, (p,), generator=gen).tolist())
        r.token_ids = torch.randint(3, 100, (c,), generator=gen).tolist()
        r.logprobs = (-torch.rand(c, generator=gen)).tolist()
        r.loss_mask = [int(x) for x in torch.rand(c, generator=gen) < 0.8]
        r.reward = float(i % 3 == 0)
        rollouts.append(r)
        cells.append(cell)
    scores = TeacherScorer(teachers[CELLS[0]]).score(
        [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=full_vocab_kl
    )
    # no IcePop mask: these made-up rollout log-probs are far from the student's, it would zero every token
    options = {"full_vocab_kl": full_vocab_kl, "orm_alpha": 0.5, "importance": {"mode": "none"}, "balance_tokens": balance_tokens}
    whole = Student.load(student_dir, spec(**options), reference_dir=student_dir)
    split = Student.load(student_dir, spec(micro_batch_tokens=64, **options), reference_dir=student_dir)
    assert len(length_sorted_micro_batches(rollouts, 64)) >= 3
    metrics = [student.train_step(rollouts, scores, cells) for student in (whole, split)]
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
    for name in ("loss", "reverse_kl", "grad_norm", "general-low/reverse_kl", "general-high/tokens", "general-low/gradient_share"):
        assert metrics[0][name] == pytest.approx(metrics[1][name], rel=1e-4, abs=1e-6), name
    tokens = {cell: metrics[0][f"{cell}/tokens"] for cell in CELLS}  # 3 rollouts each, of different lengths
    expected = {cell: 0.5 if balance_tokens else tokens[cell] / sum(tokens.values()) for cell in CELLS}
    assert {cell: metrics[0][f"{cell}/gradient_share"] for cell in CELLS} == pytest.approx(expected)


def test_staleness_beyond_the_bound_is_an_error():
    rollouts = [Rollout(Task("a", "general", "low", "q"), [1], policy_version=v) for v in (4, 3)]
    check_staleness(rollouts, current_version=4, max_staleness=1)
    with pytest.raises(StalenessError, match=r"policy version 3, 1 behind the current 4; distill\.max_staleness is 0"):
        check_staleness(rollouts, current_version=4, max_staleness=0)


def test_a_cell_without_a_teacher_fails_before_any_work(setup):
    root, student, teachers = setup
    bad = DistillSpec(mix={"general-low": 1.0, "code-max": 1.0}, teacher_actors=False)
    with pytest.raises(RoutingError, match="code-max"):
        train_mopd(student, teachers, bad, root / "never", efforts=SHORT, backend="hf", progress=False)
    assert not (root / "never").exists()


def test_mopd_steps_log_per_teacher_metrics_sync_weights_and_resume(setup):
    final = run(setup, "run", steps=2, checkpoint_every=1)
    out = final.parent
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["policy_version"] for r in records] == [0, 1]  # step 2 sampled from the weights of step 1
    assert [r["learning_rate"] for r in records] == [1e-3, 1e-3]  # lr_schedule: constant
    for cell in CELLS:
        for metric in ("reverse_kl", "reward", "thinking_tokens", "answer_tokens", "is_out_of_bounds", "train_rollout_gap"):
            assert f"{cell}/{metric}" in records[0]
    assert records[0]["train_rollout_gap"] < 1e-3  # the engine samples from exactly the trainer's weights
    assert all(r["time/sample"] > 0 and r["time/score"] > 0 and r["time/weight_sync"] > 0 for r in records)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    assert "moe/layer1/max_over_mean" in records[0]  # the MoE bias hook ran once per optimizer step
    biases = [t for name, t in K3HybridForCausalLM.from_pretrained(final).state_dict().items() if "e_score_correction_bias" in name]
    assert biases and any(b.abs().sum() > 0 for b in biases)

    # more steps on the same directory continue from step 2: no step is redone or lost
    run(setup, "run", steps=3, checkpoint_every=1)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["policy_version"] == 2
    trained = torch.load(Path(out / "checkpoints/step-000003/optimizer.pt"), weights_only=True)
    assert trained["state"][0]["step"] == 3  # the optimizer state carried across the resume


def test_the_pipeline_stage_distils_the_base_and_compares_held_out_rewards(setup):
    from mopd.distill.trainer import run_distill
    from mopd.pipeline import StageContext
    from mopd.recipe import Recipe

    root, student, teachers = setup
    distill = DistillSpec(mix={"general-low": 1.0}, steps=1, prompts_per_step=2, teacher_actors=False, eval_tasks=2)
    recipe = Recipe(name="t", rollout="hf", efforts=SHORT, envs=EASY, distill=distill)
    inputs = {"base": student, "teachers": teachers["general-low"].parent}  # teachers/<cell>/ checkpoints
    run_distill(StageContext(recipe, root / "stage", root / "stage" / "distill", inputs))
    out = root / "stage" / "distill"
    assert (out / "model" / "config.json").is_file() and (out / "model" / "tokenizer_config.json").is_file()
    scores = json.loads((out / "eval.json").read_text())["general-low"]
    assert scores["student"]["rollouts"] == scores["teacher"]["rollouts"] == 2
    for name in ("student", "teacher"):
        assert 0.0 <= scores[name]["reward"] <= 1.0
    expected = scores["student"]["reward"] / max(scores["teacher"]["reward"], 1e-9)
    assert scores["student_over_teacher"] == pytest.approx(expected)


@pytest.fixture(scope="module")
def default_step(setup):
    """The first step's metrics with the default loss (the exact full-vocabulary reverse KL)."""
    final = run(setup, "options-default", steps=1)
    (record,) = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    return record


@pytest.mark.parametrize(
    "options",
    [
        {"full_vocab_kl": False, "reward_scale": 2.0, "importance": {"mode": "tis", "low": 0.5, "high": 2.0}},
        {"full_vocab_kl": False},
        {"reward_scale": 1.5},
    ],
)
def test_loss_options_train_and_log(setup, default_step, options):
    final = run(setup, f"options-{len(options)}-{next(iter(options))}", steps=1, **options)
    (record,) = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    assert torch.isfinite(torch.tensor([record["loss"], record["grad_norm"]])).all()
    assert record["grad_norm"] > 0
    # the same rollouts and teacher scores as the default loss's first step
    for cell in CELLS:
        assert record[f"{cell}/reverse_kl"] == pytest.approx(default_step[f"{cell}/reverse_kl"], abs=1e-6)
    assert abs(record["loss"] - default_step["loss"]) > 1e-4


def test_the_outcome_term_adds_alpha_times_each_rewards_lead_over_its_prompts_group(setup, monkeypatch):
    """`orm_alpha` α with rewards that differ within each prompt's group of 2 samples (1 and 0.25: A = ±0.375
    from the group's mean): the step's loss grows by −α Σ A·log πθ(y_t) / N over its N generated tokens; with
    a group's rewards tied, by nothing. (The untrained student earns 0 everywhere: the rewards are set on the
    sampled rollouts, as a verifier that scores each sample differently would.)"""
    import mopd.distill.trainer as trainer
    from mopd.rollout.episodes import run_rollouts

    def rewarded(rewards: tuple[float, float], sampled: list[Rollout]):
        def sample(*args, **kwargs):
            groups = run_rollouts(*args, **kwargs)
            for group in groups:
                for rollout, reward in zip(group, rewards, strict=True):
                    rollout.reward = reward
            sampled.extend(r for group in groups for r in group)
            return groups

        return sample

    runs = {"plain": (0.0, (1.0, 0.25)), "outcome": (0.5, (1.0, 0.25)), "tied": (0.5, (0.5, 0.5))}
    records, sampled = {}, {name: [] for name in runs}
    for name, (alpha, rewards) in runs.items():
        monkeypatch.setattr(trainer, "run_rollouts", rewarded(rewards, sampled[name]))
        final = run(setup, f"outcome-{name}", steps=1, samples_per_prompt=2, orm_alpha=alpha)
        (records[name],) = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    rollouts = sampled["outcome"]
    assert len(rollouts) == 8 and [r.token_ids for r in rollouts] == [r.token_ids for r in sampled["plain"]]
    assert records["outcome"]["reward"] == pytest.approx(0.625)

    _, student_dir, _ = setup  # the step's loss is taken at the initial weights: score the samples with them
    logprobs = [s.logprobs for s in TeacherScorer(student_dir).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])]
    masks = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rollouts]
    lead = [0.375, -0.375] * 4  # each group's two samples, in order
    outcome = -0.5 * sum(a * float((m * lp).sum()) for a, m, lp in zip(lead, masks, logprobs, strict=True)) / float(sum(m.sum() for m in masks))
    assert abs(outcome) > 1e-3  # some 6% of the step's loss here, far above float noise
    assert records["outcome"]["loss"] - records["plain"]["loss"] == pytest.approx(outcome, rel=1e-3)
    assert records["tied"]["loss"] == pytest.approx(records["plain"]["loss"], abs=1e-7)


def test_a_cosine_schedule_sets_each_steps_learning_rate_and_the_optimizer_uses_it(setup):
    cosine = spec(lr_schedule="cosine", steps=3)
    assert [scheduled_learning_rate(cosine, step) for step in (1, 2, 3)] == pytest.approx([1e-3, 0.75e-3, 0.25e-3])
    assert [scheduled_learning_rate(spec(steps=3), step) for step in (1, 2, 3)] == [1e-3] * 3

    _, student_dir, teachers = setup
    rollout = Rollout(Task("t", "general", "low", "q"), [5, 6, 7], token_ids=[8, 9], logprobs=[-1.0, -1.0], loss_mask=[1, 1])
    scores = TeacherScorer(teachers[CELLS[0]]).score([rollout.prompt_ids], [rollout.token_ids], full=True)
    student = Student.load(student_dir, spec(), reference_dir=student_dir)
    before = [p.detach().clone() for p in student.model.parameters()]
    student.set_learning_rate(0.0)  # AdamW without weight decay: a zero rate moves nothing
    student.train_step([rollout], scores, [CELLS[0]])
    assert all(torch.equal(a, b) for a, b in zip(before, student.model.parameters(), strict=True))
    student.set_learning_rate(1e-3)
    student.train_step([rollout], scores, [CELLS[0]])
    assert not all(torch.equal(a, b) for a, b in zip(before, student.model.parameters(), strict=True))

    final = run(setup, "cosine", steps=3, lr_schedule="cosine")
    records = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["learning_rate"] for r in records] == pytest.approx([1e-3, 0.75e-3, 0.25e-3])


def test_the_outcome_baseline_is_the_prompts_group_where_it_was_sampled_more_than_once():
    def rollout(prompt, reward):
        return Rollout(Task("t", "code", "low", "q"), prompt, reward=reward)

    rollouts = [rollout([1], 1.0), rollout([1], 0.0), rollout([1], 0.0), rollout([2], 1.0), rollout([2], 1.0), rollout([3], 1.0)]
    cells = ["code-low"] * 5 + ["code-high"]
    advantages = orm_advantages(rollouts, cells).tolist()
    # prompt 1: mean 1/3; prompt 2: tied, so 0 (not 1 − the cell's 0.6); prompt 3 alone: its cell's mean, itself
    assert advantages == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    singles = orm_advantages([rollout([1], 1.0), rollout([2], 0.0)], ["code-low"] * 2).tolist()
    assert singles == pytest.approx([0.5, -0.5])  # one sample a prompt: the cell's mean in the step


def test_exopds_reference_forward_is_counted_in_the_stages_flops(setup):
    from mopd.compute import checkpoint_active_parameters
    from mopd.distill.trainer import distill_compute

    _, student_dir, teachers = setup
    records = [{"tokens_sampled": 30, "tokens_trained": 100, "tokens_scored": 100, "general-low/tokens_scored": 100}] * 2
    plain = distill_compute(records, student_dir, teachers)
    exopd = distill_compute(records, student_dir, teachers, reference_scores=spec(reward_scale=2.0).scores_a_reference)
    assert "reference_tokens_scored" not in plain and exopd["reference_tokens_scored"] == 200
    assert exopd["flops"] - plain["flops"] == 2 * checkpoint_active_parameters(student_dir) * 200
    assert not spec().scores_a_reference


def test_qat_distils_with_the_sampler_and_trainer_computing_the_same_quantized_experts(setup):
    from mopd.model.mx import quantize_dequantize
    from mopd.recipe import QATSpec

    final = run(setup, "qat", steps=2, qat=QATSpec(experts="mxfp4", activations="mxfp8"))
    records = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train_rollout_gap"] < 1e-3 for r in records)  # the engine's experts round exactly as the trainer's
    model = K3HybridForCausalLM.from_pretrained(final)
    assert model.config.routed_expert_mx == {"weights": "mxfp4", "activations": "mxfp8"}
    w1 = model.model.layers[1].block_sparse_moe.experts[0].w1.weight
    assert not torch.equal(w1, quantize_dequantize(w1, "mxfp4"))  # the master weights stay full precision
