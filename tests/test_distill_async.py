"""One-step-off sampling: at staleness 0 the loop is the synchronous one; at 1 it samples a step behind."""

import json

import pytest
import torch

from mopd.distill.routing import build_route_table, cell_of
from mopd.distill.scorer import TeacherPool
from mopd.distill.student import Student
from mopd.distill.trainer import envs_for, task_source, train_mopd
from mopd.envs.effort import EffortSpec
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import run_rollouts
from tests.fakes import seeded_copy

CELLS = ["general-low", "general-high"]
SHORT = {e: EffortSpec(budget_tokens=4, answer_tokens=4) for e in ("low", "high", "max")}
EASY = {"general": {"families": ["add"], "add_digits": [1, 1]}}
STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("mopd-async")
    torch.manual_seed(0)
    config = preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))
    K3HybridForCausalLM(config).save_pretrained(root / "student")
    tiny_tokenizer.save_pretrained(root / "student")
    teachers = {cell: seeded_copy(root / "student", root / cell, seed=i + 1) for i, cell in enumerate(CELLS)}
    return root, root / "student", teachers


def spec(**fields) -> DistillSpec:
    # the sampled-token loss: there the importance weights act on every token
    return DistillSpec(
        mix=dict.fromkeys(CELLS, 1.0), steps=STEPS, prompts_per_step=4, samples_per_prompt=2, teacher_actors=False,
        learning_rate=1e-2, full_vocab_kl=False, **fields,
    )  # fmt: skip


def records_of(setup, out: str, **fields) -> list[dict]:
    root, student, teachers = setup
    train_mopd(student, teachers, spec(**fields), root / out, efforts=SHORT, env_options=EASY, backend="hf", progress=False)
    return [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]


def synchronous_losses(setup) -> list[float]:
    """The synchronous loop written out: sample, score, train, push the weights; step after step."""
    _, student_dir, teachers = setup
    table = build_route_table(spec().mix, teachers)
    student = Student.load(student_dir, spec(), reference_dir=student_dir)
    engine = create_engine(student_dir, backend="hf")
    pool = TeacherPool(table, use_ray=False)
    source, envs = task_source(table, spec(), 0, EASY, None), envs_for(table, EASY, None)
    losses = []
    for step in range(1, STEPS + 1):
        groups = run_rollouts(engine, student.tokenizer, envs, source(step), SHORT, n=2, seed=step)
        rollouts = [r for group in groups for r in group]
        cells = [cell_of(r.task) for r in rollouts]
        scores = pool.score(cells, [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
        losses.append(student.train_step(rollouts, scores, cells)["loss"])
        engine.update_weights(student.model.state_dict())
    return losses


def test_at_staleness_0_the_loop_gives_the_synchronous_losses(setup):
    records = records_of(setup, "sync", max_staleness=0)
    assert [r["loss"] for r in records] == synchronous_losses(setup)
    assert [r["policy_version"] for r in records] == [0, 1, 2]
    assert all(r["lag/0"] == 8 and "lag/1" not in r for r in records)


def test_at_staleness_1_each_step_trains_on_samples_one_version_behind(setup):
    tight = {"mode": "icepop", "low": 0.95, "high": 1.05}  # the lag moves some tokens outside it
    records = records_of(setup, "async", max_staleness=1, importance=tight)
    # the first step has no batch in flight; every later batch was sampled while the step before it trained
    assert [r["policy_version"] for r in records] == [0, 0, 1]
    assert [(r["lag/0"], r.get("lag/1", 0)) for r in records] == [(8, 0), (0, 8), (0, 8)]
    assert records[0]["train_rollout_gap"] < 1e-3  # on-policy: the engine had the trainer's weights
    assert all(r["train_rollout_gap"] > 1e-3 for r in records[1:])  # a real gap for the importance weights
    assert records[0]["is_out_of_bounds"] == 0 and all(r["is_out_of_bounds"] > 0 for r in records[1:])
    assert records[0]["loss"] == synchronous_losses(setup)[0]  # same weights, same samples, nothing masked


def test_a_sampler_in_its_own_process_keeps_the_lag_bound_and_the_threads_samples(setup):
    """`sampler_actor`: the engine generates in a Ray actor; the loop, its lags and its samples are unchanged."""
    import ray

    tight = {"mode": "icepop", "low": 0.95, "high": 1.05}
    in_thread = records_of(setup, "async-thread", max_staleness=1, importance=tight)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        in_actor = records_of(setup, "async-actor", max_staleness=1, importance=tight, sampler_actor=True)
    finally:
        ray.shutdown()
    assert [r["policy_version"] for r in in_actor] == [0, 0, 1]
    assert [(r["lag/0"], r.get("lag/1", 0)) for r in in_actor] == [(8, 0), (0, 8), (0, 8)]
    # the same seeded samples from the same weights (pushed through Ray's object store), so the same losses
    assert [r["loss"] for r in in_actor] == [r["loss"] for r in in_thread]
    assert [r["tokens_sampled"] for r in in_actor] == [r["tokens_sampled"] for r in in_thread]
