"""MOPD across cells: token shares balanced per cell, allocation that follows the gap, lagged samples rescored."""

import json
import random

import pytest
import torch
from pydantic import ValidationError

from mopd.distill.allocation import Allocation, cell_gaps
from mopd.distill.loss import full_vocab_reverse_kl, mopd_loss, reverse_kl
from mopd.distill.routing import RouteTable
from mopd.distill.student import gradient_shares, token_weights
from mopd.distill.trainer import train_mopd
from mopd.envs.base import Task
from mopd.envs.effort import EffortSpec
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout
from tests.fakes import seeded_copy

SHORT, LONG = "general-low", "agent-max"


def rollouts_of(lengths: dict[str, int], per_cell: int = 2) -> tuple[list[Rollout], list[str]]:
    """`per_cell` rollouts of each cell, every answer of the cell `lengths[cell]` generated tokens long."""
    rollouts, cells = [], []
    for cell, length in lengths.items():
        domain, effort = cell.split("-")
        for i in range(per_cell):
            rollout = Rollout(Task(f"{cell}-{i}", domain, effort, "q"), [1, 2, 3])
            rollout.token_ids, rollout.logprobs, rollout.loss_mask = [5] * length, [-1.0] * length, [1] * length
            rollouts.append(rollout)
            cells.append(cell)
    return rollouts, cells


def per_cell_gradient_weight(rollouts, cells, balance: bool) -> dict[str, float]:
    """Each cell's total weight in the gradient of the sampled-token loss, with an advantage of 1 on every token."""
    width = max(len(r.token_ids) for r in rollouts)
    mask = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in rollouts], dtype=torch.float32)
    train = torch.full(mask.shape, -1.0, requires_grad=True)
    weights = mask * token_weights(rollouts, cells, balance)[:, None]
    mopd_loss(train, train.detach(), train.detach() + 1.0, mask, importance="none", token_weights=weights).loss.backward()
    return {cell: -float(train.grad[[i for i, c in enumerate(cells) if c == cell]].sum()) for cell in dict.fromkeys(cells)}


@pytest.mark.parametrize("balance", [True, False])
def test_a_cell_with_10x_shorter_answers_weighs_as_much_as_a_long_one_only_when_balanced(balance):
    rollouts, cells = rollouts_of({SHORT: 3, LONG: 30})
    gradient = per_cell_gradient_weight(rollouts, cells, balance)
    shares = gradient_shares(rollouts, cells, token_weights(rollouts, cells, balance))
    assert sum(gradient.values()) == pytest.approx(1.0)
    if balance:  # two rollouts each: half the gradient each
        assert gradient[SHORT] == pytest.approx(gradient[LONG]) == pytest.approx(0.5)
    else:  # every token alike: the long cell has 10x the tokens, so 10x the gradient
        assert gradient[LONG] == pytest.approx(10 * gradient[SHORT])
    assert shares == pytest.approx({f"{cell}/gradient_share": g for cell, g in gradient.items()})


def test_balanced_shares_follow_the_cells_share_of_rollouts_and_the_exact_kl_uses_them_too():
    rollouts, cells = rollouts_of({SHORT: 4, LONG: 40}, per_cell=1)
    rollouts += rollouts_of({SHORT: 4}, per_cell=2)[0]
    cells += [SHORT, SHORT]  # 3 of 4 rollouts are short: 3/4 of the gradient, though 12 of 52 tokens
    weights = token_weights(rollouts, cells, balance=True)
    assert gradient_shares(rollouts, cells, weights) == pytest.approx({f"{SHORT}/gradient_share": 0.75, f"{LONG}/gradient_share": 0.25})
    # the exact full-vocabulary KL takes the same weights: at the same KL on every token, the step's loss is that KL
    width = 40
    mask = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in rollouts], dtype=torch.float32)
    student, teacher = torch.zeros(len(rollouts), width, 3), torch.tensor([0.0, 1.0, 2.0]).expand(len(rollouts), width, 3)
    per_token = reverse_kl(torch.log_softmax(student[0, 0], -1), torch.log_softmax(teacher[0, 0], -1))
    assert float(full_vocab_reverse_kl(student, teacher, mask, mask * weights[:, None])) == pytest.approx(float(per_token))


def test_a_lagged_samples_advantage_is_formed_under_the_current_student():
    """One step off, the sampler's log-probs are a version old; the advantage log πT − log πθ uses the trainer's
    log-probs of this step's weights (the teacher's are kept), so stale sampler log-probs change nothing but the
    importance weights."""
    gen = torch.Generator().manual_seed(0)
    current = (-torch.rand(3, 6, generator=gen)).requires_grad_()
    teacher, mask = -torch.rand(3, 6, generator=gen), torch.ones(3, 6)
    grads = []
    for sampler in (current.detach(), current.detach() - 2.0):  # the same policy, then a stale one
        current.grad = None
        mopd_loss(current, sampler, teacher, mask, importance="none").loss.backward()
        grads.append(current.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], -(teacher - current.detach()) / mask.sum())


def test_without_rescoring_a_stale_samples_advantage_keeps_the_samplers_log_probs():
    """`rescore: false` (kept to measure rescoring): the advantage is log πT − log π_sampler, so a sampler two
    nats stale shifts every token's advantage by two nats."""
    gen = torch.Generator().manual_seed(0)
    current = (-torch.rand(3, 6, generator=gen)).requires_grad_()
    teacher, mask = -torch.rand(3, 6, generator=gen), torch.ones(3, 6)
    stale = current.detach() - 2.0
    mopd_loss(current, stale, teacher, mask, importance="none", rescore=False).loss.backward()
    torch.testing.assert_close(current.grad, -(teacher - stale) / mask.sum())


def test_rescore_false_is_refused_with_the_exact_kl_naming_both_fields():
    with pytest.raises(ValidationError, match=r"rescore: false needs full_vocab_kl: false"):
        DistillSpec(rescore=False, full_vocab_kl=True)
    DistillSpec(rescore=False, full_vocab_kl=False)


# ----------------------------------------------------------------------------- allocation
CELLS3 = ["general-low", "code-high", "agent-max"]
GAPS = {"general-low": 0.0, "code-high": 0.2, "agent-max": 0.6}


def gap_spec(**fields) -> DistillSpec:
    options = {"mix": dict.fromkeys(CELLS3, 1.0), "prompts_per_step": 12, "allocation": "gap", "allocation_every": 2,
               "allocation_floor": 1, **fields}  # fmt: skip
    return DistillSpec(**options)


def step_record(gaps: dict[str, float], tokens: float = 10.0) -> dict[str, float]:
    return {**{f"{c}/reverse_kl": g for c, g in gaps.items()}, **{f"{c}/tokens": tokens for c in gaps}}


def test_gap_allocation_sends_more_prompts_to_the_larger_gap_and_never_fewer_than_the_floor():
    spec = gap_spec()
    table = RouteTable(routes={}, weights=dict(spec.mix))
    allocation = Allocation(table, spec)
    for step in range(1, 31):
        cells = allocation.cells(step, random.Random(step))
        counts = {cell: cells.count(cell) for cell in CELLS3}
        assert len(cells) == spec.prompts_per_step
        if step > spec.allocation_every:  # once measured: the floor, then the rest by the gap (0 : 0.2 : 0.6)
            assert counts["agent-max"] > counts["code-high"] > counts["general-low"] == spec.allocation_floor
            assert counts["agent-max"] in (7, 8) and counts["code-high"] in (3, 4)
        else:  # before any step is measured: the (even) mix
            assert all(count == 4 for count in counts.values())
        allocation.observe(step, step_record(GAPS))


def test_the_floor_holds_however_lopsided_the_gap():
    spec = gap_spec(allocation_floor=3, allocation_every=1)
    allocation = Allocation(RouteTable(routes={}, weights=dict(spec.mix)), spec, [{"step": 1, **step_record({**GAPS, "code-high": 0.0})}])
    cells = allocation.cells(2, random.Random(0))
    assert {cell: cells.count(cell) for cell in CELLS3} == {"general-low": 3, "code-high": 3, "agent-max": 6}


def test_static_allocation_draws_exactly_the_mix():
    spec = gap_spec(allocation="static", mix={"general-low": 2.0, "code-high": 3.0, "agent-max": 1.0})
    table = RouteTable(routes={}, weights=dict(spec.mix))
    allocation = Allocation(table, spec, [{"step": s, **step_record(GAPS)} for s in (1, 2, 3)])
    for step in (1, 4, 9):
        assert allocation.cells(step, random.Random(step)) == table.sample_cells(12, random.Random(step))


def test_the_window_ends_before_the_step_still_training_when_sampling_runs_one_step_off():
    table = RouteTable(routes={}, weights=dict.fromkeys(CELLS3, 1.0))
    synchronous = Allocation(table, gap_spec(allocation_every=4))
    one_step_off = Allocation(table, gap_spec(allocation_every=4, max_staleness=1))
    assert list(synchronous.window(5)) == list(synchronous.window(8)) == [1, 2, 3, 4]
    assert list(one_step_off.window(5)) == [1, 2, 3]
    assert list(synchronous.window(3)) == [] and list(one_step_off.window(9)) == [4, 5, 6, 7]


def test_a_cell_without_samples_counts_at_the_largest_gap_and_a_negative_estimate_at_zero():
    measured = [{"general-low": (-0.1, 5.0), "code-high": (0.3, 10.0)}, {"code-high": (0.1, 30.0)}]
    assert cell_gaps(measured, CELLS3) == pytest.approx({"general-low": 0.0, "code-high": 0.15, "agent-max": 0.15})
    assert cell_gaps([{"general-low": (-1.0, 3.0)}], ["general-low", "code-high"]) == {"general-low": 1.0, "code-high": 1.0}


def test_a_floor_the_step_cannot_hold_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match=r"allocation_floor: 5 prompts for each of the mix's 3 cells is more than prompts_per_step \(12\)"):
        gap_spec(allocation_floor=5)
    gap_spec(allocation="static", allocation_floor=5)  # the floor binds only gap allocation


# ----------------------------------------------------------------------------- a run
CELLS2 = ["general-low", "general-high"]


def test_a_gap_run_logs_its_allocation_and_gradient_shares_and_plots_them(tmp_path, tiny_tokenizer):
    torch.manual_seed(0)
    config = preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))
    K3HybridForCausalLM(config).save_pretrained(tmp_path / "student")
    tiny_tokenizer.save_pretrained(tmp_path / "student")
    teachers = {cell: seeded_copy(tmp_path / "student", tmp_path / cell, seed=i + 1) for i, cell in enumerate(CELLS2)}
    spec = DistillSpec(mix=dict.fromkeys(CELLS2, 1.0), prompts_per_step=4, steps=3, teacher_actors=False, learning_rate=1e-3,
                       allocation="gap", allocation_every=1, balance_tokens=True)  # fmt: skip
    efforts = {e: EffortSpec(budget_tokens=4, answer_tokens=4) for e in ("low", "high", "max")}
    final = train_mopd(tmp_path / "student", teachers, spec, tmp_path / "run", efforts=efforts, backend="hf", progress=False,
                       env_options={"general": {"families": ["add"], "add_digits": [1, 1]}})  # fmt: skip
    records = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        allocation = [record[f"allocation/{cell}"] for cell in CELLS2]
        assert sum(allocation) == pytest.approx(1.0) and min(allocation) >= 1 / 4  # the floor: 1 of 4 prompts
        shares = {cell: record.get(f"{cell}/gradient_share", 0.0) for cell in CELLS2}
        assert shares == pytest.approx(dict(zip(CELLS2, allocation, strict=True)))  # balanced: gradient share = prompt share
    assert (final.parent / "allocation.png").stat().st_size > 0
