"""Precision as a setting: bf16 autocast in MOPD's student step and teacher scoring, and its refusals.

The bf16 tests run on any CPU (torch emulates bf16 where the CPU lacks it); only whether a machine
*supports* bf16 depends on it, and that is injected here.
"""

import json
from pathlib import Path

import pytest
import torch

import mopd.precision
from mopd.distill.scorer import TeacherScorer
from mopd.distill.student import Student, collate, orm_advantages, token_weights
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.precision import PrecisionError, bf16_supported, check_precision, cpu_flags
from mopd.recipe import ROOT, DistillSpec, Recipe, RecipeError, load_recipe, validate
from tests.fakes import seeded_copy
from tests.test_distill_sharded import CELLS, made_up_step

LAYERS = 2
BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significand bits (7 stored + the implicit one)
# Sequential matmuls a token's logits pass through: per layer the mixer's input projection, its two
# attention/recurrence products and its output projection, the MLP's up and down; then the LM head.
MATMUL_DEPTH = LAYERS * 6 + 1
# Each matmul under autocast rounds both operands and its result to bf16 (fp32 accumulation): at most
# 3u relative error; to first order these add along the depth. The loss: 3u·D. The gradient runs the
# backward's matmuls over the same depth again: 3u·2D.
LOSS_RTOL = 3 * BF16_UNIT_ROUNDOFF * MATMUL_DEPTH  # 39u ≈ 0.152
GRADIENT_RTOL = 3 * BF16_UNIT_ROUNDOFF * 2 * MATMUL_DEPTH  # 78u ≈ 0.305


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("precision")
    torch.manual_seed(0)
    config = preset_config("tiny", num_hidden_layers=LAYERS, vocab_size=len(tiny_tokenizer))
    K3HybridForCausalLM(config).save_pretrained(root / "student")
    tiny_tokenizer.save_pretrained(root / "student")
    return root / "student", seeded_copy(root / "student", root / "teacher", seed=1)


def loss_and_gradient(student: Student, rollouts, scores, cells) -> tuple[float, torch.Tensor]:
    """The step's loss and the gradient of every parameter, flattened (no optimizer step)."""
    batch = collate(rollouts, scores, student.model.config.pad_token_id or 0)
    weights = token_weights(rollouts, cells, balance=False)
    student.model.zero_grad(set_to_none=True)
    loss, _ = student.micro_batch_loss(batch, scores, orm_advantages(rollouts, cells), weights)
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in student.model.parameters() if p.grad is not None])


def test_a_bf16_student_step_matches_fp32_within_bf16_rounding_yet_differs(dirs):
    """Same weights, same batch: bf16 autocast's loss and gradient lie within the derived bound of
    fp32's (see LOSS_RTOL, GRADIENT_RTOL), and are not bit-identical (bf16 really ran)."""
    student_dir, teacher_dir = dirs
    rollouts, scores, cells = made_up_step(teacher_dir)
    options = dict(mix=dict.fromkeys(CELLS, 1.0), orm_alpha=0.5, importance={"mode": "none"})
    fp32_loss, fp32_grad = loss_and_gradient(
        Student.load(student_dir, DistillSpec(precision="fp32", **options), student_dir), rollouts, scores, cells
    )
    bf16_loss, bf16_grad = loss_and_gradient(
        Student.load(student_dir, DistillSpec(precision="bf16", **options), student_dir), rollouts, scores, cells
    )
    loss_error = abs(bf16_loss - fp32_loss) / abs(fp32_loss)
    gradient_error = float((bf16_grad - fp32_grad).norm() / fp32_grad.norm())
    print(f"bf16 vs fp32: loss rel. error {loss_error:.2e} (bound {LOSS_RTOL:.3f}), "
          f"gradient rel. error {gradient_error:.2e} (bound {GRADIENT_RTOL:.3f})")  # fmt: skip
    assert bf16_grad.dtype == torch.float32  # fp32 master weights, so fp32 gradients
    assert loss_error <= LOSS_RTOL and gradient_error <= GRADIENT_RTOL
    assert bf16_loss != fp32_loss and not torch.equal(bf16_grad, fp32_grad)


def test_a_bf16_train_step_keeps_fp32_weights_and_adamw_state(dirs):
    student_dir, teacher_dir = dirs
    rollouts, scores, cells = made_up_step(teacher_dir)
    student = Student.load(student_dir, DistillSpec(precision="bf16", mix=dict.fromkeys(CELLS, 1.0)), student_dir)
    metrics = student.train_step(rollouts, scores, cells)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert {p.dtype for p in student.model.parameters()} == {torch.float32}
    state = student.optimizer.state_dict()["state"].values()
    assert {s["exp_avg"].dtype for s in state} | {s["exp_avg_sq"].dtype for s in state} == {torch.float32}


def test_bf16_teacher_scores_are_fp32_log_probs_near_fp32_scoring(dirs):
    _, teacher_dir = dirs
    rollouts, _, _ = made_up_step(teacher_dir)
    prompts, completions = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
    fp32 = TeacherScorer(teacher_dir).score(prompts, completions, full=True)
    bf16 = TeacherScorer(teacher_dir, precision="bf16").score(prompts, completions, full=True)
    fp32_full, bf16_full = torch.cat([s.full_logprobs for s in fp32]), torch.cat([s.full_logprobs for s in bf16])
    assert bf16_full.dtype == torch.float32
    assert float((bf16_full - fp32_full).norm() / fp32_full.norm()) <= LOSS_RTOL
    assert not torch.equal(bf16_full, fp32_full)


# ----------------------------------------------------------------------------- the setting
def test_a_bad_precision_is_refused_naming_the_field():
    for data, field in [({"precision": "fp16"}, "`precision`"), ({"distill": {"precision": "fp16"}}, "`distill.precision`")]:
        with pytest.raises(RecipeError, match=f"r.yaml: field {field}: Input should be 'fp32' or 'bf16'"):
            validate(Recipe, {"name": "r", **data}, source="r.yaml")


def test_the_distill_stage_takes_the_recipes_precision_unless_it_sets_its_own():
    assert Recipe(name="r").distill.precision is None  # fp32: unset, so stage hashes of earlier runs hold
    assert Recipe(name="r", precision="bf16").distill.precision == "bf16"
    assert Recipe(name="r", precision="bf16", distill={"precision": "fp32"}).distill.precision == "fp32"


def test_tiny_recipe_stage_configs_do_not_mention_precision():
    """Recipes that leave precision unset hash their stages as before the setting existed."""
    from mopd.pipeline import build_stages

    path = ROOT / "recipes" / "tiny.yaml"
    for stage in build_stages(load_recipe(path), path.parent):
        assert "precision" not in json.dumps(stage.config), stage.name


# ----------------------------------------------------------------------------- the machine
def test_bf16_support_is_read_from_the_cpu_flags(tmp_path: Path):
    assert bf16_supported("cpu", flags=["avx2", "avx512_bf16"]) and bf16_supported("cpu", flags=["amx_bf16"])
    assert not bf16_supported("cpu", flags=["avx2", "avx512f"])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx512f", "amx_bf16"}
    assert cpu_flags(tmp_path / "absent") == set()


def test_bf16_is_refused_naming_the_field_where_the_machine_lacks_it():
    message = "distill.precision: bf16 needs a CPU with AVX-512 BF16 or AMX (this one has neither); use fp32"
    with pytest.raises(PrecisionError) as refused:
        check_precision("bf16", "cpu", "distill.precision", supported=False)
    assert str(refused.value) == message
    check_precision("bf16", "cpu", "distill.precision", supported=True)
    check_precision("fp32", "cpu", "distill.precision", supported=False)
    check_precision(None, "cpu", "distill.precision", supported=False)


def test_mopd_refuses_bf16_before_loading_a_model_where_the_machine_lacks_it(dirs, tmp_path, monkeypatch):
    import mopd.precision
    from mopd.distill.trainer import train_mopd

    student_dir, teacher_dir = dirs
    monkeypatch.setattr(mopd.precision, "bf16_supported", lambda device: False)
    monkeypatch.setattr("mopd.distill.trainer.load_student", lambda *args: pytest.fail("loaded the student"))
    spec = DistillSpec(precision="bf16", mix={"general-low": 1.0})
    with pytest.raises(PrecisionError, match=r"^distill\.precision: bf16 needs a CPU "):
        train_mopd(student_dir, {"general-low": teacher_dir}, spec, tmp_path / "out", efforts={}, device="cpu")


def test_mopd_distill_takes_precision_defaulting_to_the_schemas():
    from tests.test_distill_pair import distill_args, distill_parser

    assert distill_args().precision == Recipe.model_fields["precision"].default == "fp32"
    assert distill_args("--precision", "bf16").precision == "bf16"
    with pytest.raises(SystemExit):
        distill_args("--precision", "fp16")
    shown = " ".join(distill_parser().format_help().split())
    assert "default fp32: the schema's (a recipe's `precision`)" in shown


def test_validate_refuses_bf16_up_front_where_the_machine_lacks_it(monkeypatch):
    """`mopd validate` / `mopd run` refuse before the base and teachers train, naming the recipe and the field."""
    from mopd.validate import check_recipe

    tiny = str(ROOT / "recipes" / "tiny.yaml")
    monkeypatch.setattr(mopd.precision, "bf16_supported", lambda device: False)
    with pytest.raises(RecipeError, match=r"tiny\.yaml: field `base\.precision`: bf16 needs a CPU"):
        check_recipe(tiny, ["precision=bf16"])  # the base stage, the first to train, is named first
    with pytest.raises(RecipeError, match=r"tiny\.yaml: field `distill\.precision`: bf16 needs a CPU"):
        check_recipe(tiny, ["distill.precision=bf16"])
    assert check_recipe(tiny, ["precision=fp32"])[0].distill.precision is None
    monkeypatch.setattr(mopd.precision, "bf16_supported", lambda device: True)
    assert check_recipe(tiny, ["precision=bf16"])[0].distill.precision == "bf16"


# ----------------------------------------------------------------------------- GRPO (teachers, mixed RL)
def test_grpo_policies_take_the_recipes_bf16_and_trl_trains_as_their_precision_says():
    from mopd.recipe import load_teacher_specs
    from mopd.rl.grpo import grpo_config
    from mopd.rl.mixed import mixed_rl_spec

    tiny = ROOT / "recipes" / "tiny.yaml"
    fp32, bf16 = load_recipe(tiny), load_recipe(tiny, ["precision=bf16"])
    assert {s.precision for s in load_teacher_specs(fp32, tiny.parent).values()} == {None}  # unset: hashes hold
    assert {s.precision for s in load_teacher_specs(bf16, tiny.parent).values()} == {"bf16"}
    smoke = ROOT / "recipes" / "smoke.yaml"  # a recipe with the mixed-RL baseline
    assert mixed_rl_spec(load_recipe(smoke, ["precision=bf16"])).precision == "bf16"
    assert mixed_rl_spec(load_recipe(smoke)).precision is None
    own = load_recipe(tiny, ["precision=bf16", "teachers.common.precision=fp32"])
    assert {s.precision for s in load_teacher_specs(own, tiny.parent).values()} == {"fp32"}  # a stage's own setting wins
    spec = load_teacher_specs(fp32, tiny.parent)["general-low"]
    for precision, trl_bf16, sampler in [(None, False, "float32"), ("fp32", False, "float32"), ("bf16", True, "bfloat16")]:
        policy = spec.model_copy(update={"precision": precision})
        assert grpo_config(policy, fp32, Path("/tmp/unused"), 8).bf16 is trl_bf16  # CPU: TRL's default is fp32
        assert policy.sampler_dtype == sampler


def test_grpo_refuses_bf16_before_its_engine_starts_where_the_machine_lacks_it(tmp_path, monkeypatch):
    from mopd.recipe import load_teacher_specs
    from mopd.rl.grpo import train_grpo

    tiny = ROOT / "recipes" / "tiny.yaml"
    recipe = load_recipe(tiny, ["precision=bf16"])
    spec = load_teacher_specs(recipe, tiny.parent)["general-low"]
    monkeypatch.setattr(mopd.precision, "bf16_supported", lambda device: False)
    monkeypatch.setattr("mopd.rl.grpo.create_engine", lambda *args, **kwargs: pytest.fail("started the engine"))
    with pytest.raises(PrecisionError, match=r"^teachers/general-low\.yaml: precision: bf16 needs a CPU"):
        train_grpo(spec, recipe, tmp_path / "init", tmp_path / "out", {}, [], {})
