"""The student sharded with FSDP2 on 2 gloo ranks (Ray actors) takes the one-process student's step."""

import pytest
import ray
import torch

import mopd.model.moe
from mopd.distill.scorer import TeacherScorer
from mopd.distill.sharded import ShardedStudent
from mopd.distill.student import Student, length_sorted_micro_batches
from mopd.distill.trainer import load_student, save_checkpoint
from mopd.envs.base import Task
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout
from tests.fakes import seeded_copy

CELLS = ["general-low", "general-high"]
MICRO_BATCH_TOKENS = 64


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    config = preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))
    K3HybridForCausalLM(config).save_pretrained(root / "student")
    tiny_tokenizer.save_pretrained(root / "student")
    return root, root / "student", seeded_copy(root / "student", root / "teacher", seed=1)


@pytest.fixture(scope="module")
def local_ray():
    # the ranks run every MoE micro-batch through the routed experts (real batches do, past 1,024 tokens
    # at 8 experts): an expert no token of a rank picked has no gradient there; the driver stays dense
    def sparse_experts():  # nested: Ray ships it by value to every worker
        mopd.model.moe.DENSE_EXPERT_PAIRS = 0

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"worker_process_setup_hook": sparse_experts})
    yield
    ray.shutdown()


def made_up_step(teacher_dir, lengths=((6, 3), (30, 40), (4, 8), (9, 5), (25, 2), (5, 30), (12, 12))):
    """Rollouts of mixed (prompt, completion) lengths and cells, with a teacher's scores of them (full
    distributions too: either loss of `distill.full_vocab_kl` can train on them)."""
    gen = torch.Generator().manual_seed(1)
    rollouts, cells = [], []
    for i, (p, c) in enumerate(lengths):
        cell = CELLS[i % 2]
        r = Rollout(Task(f"t{i}", "general", cell.split("-")[1], "q"), torch.randint(3, 100, (p,), generator=gen).tolist())
        r.token_ids = torch.randint(3, 100, (c,), generator=gen).tolist()
        r.logprobs = (-torch.rand(c, generator=gen)).tolist()
        r.loss_mask = [int(x) for x in torch.rand(c, generator=gen) < 0.8]
        r.reward = float(i % 3 == 0)
        rollouts.append(r)
        cells.append(cell)
    scores = TeacherScorer(teacher_dir).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=True)
    return rollouts, scores, cells


def test_two_gloo_ranks_resume_a_one_process_checkpoint_and_take_its_next_steps(dirs, local_ray):
    root, student_dir, teacher_dir = dirs
    rollouts, scores, cells = made_up_step(teacher_dir)
    few = made_up_step(teacher_dir, lengths=((2, 1), (2, 2), (3, 1), (2, 1)))  # each rank leaves experts unpicked
    # no IcePop mask: these made-up rollout log-probs are far from the student's, it would zero every token
    options = dict(
        mix=dict.fromkeys(CELLS, 1.0), learning_rate=1e-3, max_grad_norm=0.1, micro_batch_tokens=MICRO_BATCH_TOKENS,
        orm_alpha=0.5, importance={"mode": "none"},
    )  # fmt: skip
    one = Student.load(student_dir, DistillSpec(**options), reference_dir=student_dir)
    one.train_step(rollouts, scores, cells)
    resume_from = save_checkpoint(root / "one", 1, one)  # weights, MoE bias and AdamW moments of step 1
    one_metrics = one.train_step(rollouts, scores, cells)
    one_checkpoint = save_checkpoint(root / "one-2", 2, one)  # beside: a checkpoint removes the older ones
    one.set_learning_rate(2.5e-4)  # step 3 at another rate (`lr_schedule`), on both
    one_few = one.train_step(*few)

    sharded = load_student(resume_from, DistillSpec(trainer_workers=2, **options), student_dir, "cpu", None)
    assert isinstance(sharded, ShardedStudent)
    try:
        metrics = sharded.train_step(rollouts, scores, cells)
        checkpoint = save_checkpoint(root / "sharded", 2, sharded)
        sharded.set_learning_rate(2.5e-4)
        sharded_few = sharded.train_step(*few)
    finally:
        sharded.close()

    # the ranks' shares do not cut into as many micro-batches: the zero-weight passes are exercised
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].token_ids))
    counts = {len(length_sorted_micro_batches([rollouts[i] for i in order[r::2]], MICRO_BATCH_TOKENS)) for r in (0, 1)}
    assert len(counts) == 2

    assert one_metrics["grad_norm"] > 0.1  # clipping acted on both
    for name in ("loss", "grad_norm", "reverse_kl", "general-low/reverse_kl", "general-high/tokens"):
        assert metrics[name] == pytest.approx(one_metrics[name], rel=1e-4, abs=1e-6), name
    moe = [name for name in one_metrics if name.startswith("moe/")]
    assert moe and all(metrics[name] == pytest.approx(one_metrics[name], rel=1e-5) for name in moe)

    # step 2: the sharded checkpoint is a plain HF one, with the one-process weights
    expected = K3HybridForCausalLM.from_pretrained(one_checkpoint).state_dict()
    before = K3HybridForCausalLM.from_pretrained(resume_from).state_dict()
    saved = K3HybridForCausalLM.from_pretrained(checkpoint).state_dict()
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0, msg=name)
    moved = [name for name in expected if not torch.equal(expected[name], before[name])]
    assert any("e_score_correction_bias" in name for name in moved)  # the balancing update ran on both
    assert len(moved) > len(expected) // 2

    # ... and its optimizer.pt the one-process format and state: either run resumes the other's checkpoint
    optimizer, one_optimizer = (torch.load(c / "optimizer.pt", weights_only=True) for c in (checkpoint, one_checkpoint))
    assert [g["params"] for g in optimizer["param_groups"]] == [g["params"] for g in one_optimizer["param_groups"]]
    assert optimizer["state"].keys() == one_optimizer["state"].keys()
    for index, state in one_optimizer["state"].items():
        assert float(optimizer["state"][index]["step"]) == float(state["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer["state"][index][moment], state[moment], atol=1e-7, rtol=1e-4)

    # step 3, with experts no token picked (no gradient, on either rank): the same weights still
    assert [name for name, p in one.model.named_parameters() if ".experts." in name and not p.grad.any()]
    assert sharded_few["grad_norm"] == pytest.approx(one_few["grad_norm"], rel=1e-4)
    for name, tensor in one.model.state_dict().items():
        torch.testing.assert_close(sharded.model.state_dict()[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_workers_that_do_not_fit_the_cluster_are_an_error_not_a_hang(dirs, local_ray, monkeypatch):
    import mopd.distill.sharded as sharded

    _, student_dir, _ = dirs
    monkeypatch.setattr(sharded, "PLACEMENT_TIMEOUT_S", 1)
    spec = DistillSpec(mix=dict.fromkeys(CELLS, 1.0), trainer_workers=3)  # 3 CPUs on a 2-CPU Ray
    with pytest.raises(RuntimeError, match=r"distill\.trainer_workers: 3 workers of \{'CPU': 1\} each did not fit"):
        ShardedStudent.load(student_dir, spec, reference_dir=student_dir)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_a_stock_architecture_shards_by_decoder_layer_and_takes_the_one_process_step(tmp_path, tiny_tokenizer, local_ray):
    """A Llama student (any HF causal LM): FSDP2 units are its decoder layers; no MoE records to share."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "student")
    tiny_tokenizer.save_pretrained(tmp_path / "student")
    teacher = seeded_copy(tmp_path / "student", tmp_path / "teacher", seed=1)
    rollouts, scores, cells = made_up_step(teacher)
    options = dict(mix=dict.fromkeys(CELLS, 1.0), learning_rate=1e-3, micro_batch_tokens=MICRO_BATCH_TOKENS, importance={"mode": "none"})
    one = Student.load(tmp_path / "student", DistillSpec(**options), reference_dir=tmp_path / "student")
    one_metrics = one.train_step(rollouts, scores, cells)
    sharded = load_student(tmp_path / "student", DistillSpec(trainer_workers=2, **options), tmp_path / "student", "cpu", None)
    try:
        metrics = sharded.train_step(rollouts, scores, cells)
        checkpoint = save_checkpoint(tmp_path / "sharded", 1, sharded)
    finally:
        sharded.close()
    for name in ("loss", "grad_norm", "reverse_kl"):
        assert metrics[name] == pytest.approx(one_metrics[name], rel=1e-4, abs=1e-6), name
    saved = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    for name, tensor in one.model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0, msg=name)
    # a fresh start, not a resume (which takes the saved groups): the ranks build the one-process AdamW, fused too
    groups = torch.load(checkpoint / "optimizer.pt", weights_only=True)["param_groups"]
    assert groups == one.optimizer_state()["param_groups"] and groups[0]["fused"]
