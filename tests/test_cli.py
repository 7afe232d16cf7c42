"""`mopd validate` and the recipe schema: one clear error naming file and field, exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from mopd.cli import main
from mopd.recipe import CELLS, load_recipe, load_teacher_specs

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes/tiny.yaml")


def run_cli(*args: str) -> int:
    return main(list(args))


NEEDS_REAL_MODEL = {"smollm2.yaml"}  # its base is imported first; tests/test_real_model.py validates and runs it


@pytest.mark.parametrize("recipe", sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name not in NEEDS_REAL_MODEL), ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe, capsys):
    assert run_cli("validate", str(recipe)) == 0
    assert "9 teacher specs" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("name: [unclosed", "not valid YAML (line 1"),
        ("- name: x\n- seed: 1\n", "the top level must be a mapping"),
        ("name: x\nbogus_key: 1\n", "unknown field `bogus_key`"),
        ("name: x\ndistill: {steps: many}\n", "field `distill.steps`"),
        ("name: x\nteachers: {overrides: {code-maxx: {steps: 1}}}\n", "unknown teacher cell 'code-maxx'"),
        ("seed: 1\n", "field `name`: Field required"),
        (
            "name: x\nefforts: {low: {budget_tokens: 16}, high: {budget_tokens: 96}, max: {budget_tokens: 4096}}\n",
            "efforts.max: a turn of 4162 tokens (4096 thinking + 64 answer + 2 tags) leaves no room for a prompt in max_model_len 2048",
        ),
        ("name: x\nmax_model_len: 9000\n", "max_model_len 9000 exceeds the model's max_position_embeddings 8192 (preset 'tiny')"),
    ],
    ids=["empty", "bad-yaml", "list", "unknown-key", "wrong-type", "unknown-cell", "missing-name", "turn-too-long", "positions"],
)
def test_bad_recipes_get_one_clear_error(tmp_path, capsys, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert run_cli("validate", str(bad)) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_teacher_spec_typo_names_the_spec_file(tmp_path, capsys):
    (tmp_path / "teachers").mkdir()
    for cell in CELLS:
        (tmp_path / "teachers" / f"{cell}.yaml").write_text((ROOT / "teachers" / f"{cell}.yaml").read_text())
    (tmp_path / "teachers" / "code-max.yaml").write_text("domain: code\neffort: max\nstesp: 3\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nteachers: {{spec_dir: {tmp_path / 'teachers'}}}\n")
    assert run_cli("validate", str(recipe)) == 2
    err = capsys.readouterr().err
    assert "code-max.yaml" in err and "unknown field `stesp`" in err


def test_overrides_reach_teacher_specs_and_reject_bad_values():
    recipe = load_recipe(ROOT / "recipes/tiny.yaml", ["teachers.code-max.steps=50", "distill.steps=7"])
    specs = load_teacher_specs(recipe)
    assert specs["code-max"].steps == 50 and specs["code-low"].steps != 50
    assert recipe.distill.steps == 7


def test_validate_refuses_micro_batches_that_do_not_split_a_teachers_step(capsys):
    # Found when a smaller step reached a Ray actor before anything refused it.
    overrides = ("teachers.common.prompts_per_step=2", "teachers.common.group_size=2")
    assert run_cli("validate", str(ROOT / "recipes/smollm2.yaml"), *overrides) == 2
    err = capsys.readouterr().err
    assert "micro_batch_size 8 must divide prompts_per_step × group_size = 4" in err and "general-low" in err


def test_bad_override_is_a_clear_error(capsys):
    assert run_cli("validate", str(ROOT / "recipes/tiny.yaml"), "distill.stepz=3") == 2
    assert "unknown field `distill.stepz`" in capsys.readouterr().err
    assert run_cli("validate", str(ROOT / "recipes/tiny.yaml"), "nonsense") == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_console_script_help_and_exit_status():
    exe = Path(sys.executable).parent / "mopd"
    shown = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "validate", "export"):
        assert command in shown.stdout
    bad = subprocess.run([exe, "validate", "no/such/recipe.yaml"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no/such/recipe.yaml: no such file" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_export_writes_kimi_linear_or_names_what_blocks_it(tmp_path, capsys):
    from mopd.model import K3HybridForCausalLM, preset_config

    plain = dict(attn_res_block_size=None, routed_expert_hidden_size=None, mla_use_output_gate=False,
                 q_lora_rank=None, hidden_act="silu",
                 linear_attn_config={"gate_lower_bound": None, "use_full_rank_gate": False})
    K3HybridForCausalLM(preset_config("tiny", vocab_size=64, **plain)).save_pretrained(tmp_path / "plain")
    K3HybridForCausalLM(preset_config("tiny", vocab_size=64)).save_pretrained(tmp_path / "k3")
    assert run_cli("export", str(tmp_path / "plain"), str(tmp_path / "out")) == 0
    assert '"model_type": "kimi_linear"' in (tmp_path / "out" / "config.json").read_text()
    capsys.readouterr()  # drop save_pretrained's progress output
    assert run_cli("export", str(tmp_path / "k3"), str(tmp_path / "out2")) == 2
    err = capsys.readouterr().err
    assert "attn_res_block_size" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_export_quantize_packs_the_experts_and_prints_their_bytes_or_refuses_a_stray_flag(tmp_path, capsys):
    from mopd.model import K3HybridForCausalLM, preset_config

    K3HybridForCausalLM(preset_config("tiny", vocab_size=64)).save_pretrained(tmp_path / "k3")
    capsys.readouterr()
    assert run_cli("export", str(tmp_path / "k3"), str(tmp_path / "mx"), "--quantize", "mxfp4") == 0
    out = capsys.readouterr().out
    assert "MXFP4 routed experts" in out and "0.269 of bf16" in out
    assert '"format": "mxfp4-pack-quantized"' in (tmp_path / "mx" / "config.json").read_text()
    assert run_cli("export", str(tmp_path / "k3"), str(tmp_path / "x"), "--activations", "none") == 2
    err = capsys.readouterr().err
    assert "--activations" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_overrides_may_follow_options(tmp_path):
    from mopd.cli import build_parser, parse

    args = parse(build_parser(), ["run", "recipes/tiny.yaml", "--out", str(tmp_path), "distill.steps=3"])
    assert args.out == str(tmp_path) and args.overrides == ["distill.steps=3"]
    with pytest.raises(SystemExit):
        parse(build_parser(), ["run", "recipes/tiny.yaml", "--out", str(tmp_path), "--nope"])
    with pytest.raises(SystemExit):  # `export` takes no overrides
        parse(build_parser(), ["export", "a", "b", "x=1"])


def bad_checkpoints(root: Path) -> dict[str, Path]:
    """Directories that are not checkpoints: missing, without config.json, with a broken one, of an unknown
    architecture, a llama config without weights."""
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (root / "alien").mkdir()
    (root / "alien" / "config.json").write_text('{"model_type": "no_such_architecture"}')
    (root / "short").mkdir()  # a complete checkpoint with fewer positions than tiny's max_model_len (2048)
    (root / "short" / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    (root / "short" / "model.safetensors").write_bytes(b"")
    return {"missing": root / "missing", "empty": root / "empty", "broken": root / "broken", "llama": root / "llama",
            "alien": root / "alien", "short": root / "short"}  # fmt: skip


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("bench.suite=eval/does_not_exist.yaml", "bench.suite", "eval/does_not_exist.yaml: no such file"),
        ("teachers.spec_dir=no/such/specs", "teachers.spec_dir", "no/such/specs: no such directory"),
        ("base.checkpoint={missing}", "base.checkpoint", "missing: no such checkpoint directory"),
        ("distill.student={empty}", "distill.student", "empty: not a checkpoint (no config.json)"),
        ("distill.teachers.code-max={broken}", "distill.teachers.code-max", "config.json is unreadable"),
        ("teachers.code-max.init={llama}", "teachers.code-max.init", "has a config but no weights"),
        ("base.checkpoint={alien}", "base.checkpoint", "not a config transformers can read"),
        ("distill.student={short}", "distill.student", "max_position_embeddings 512 is below max_model_len 2048"),
        ("teachers.cells=[code-max]", "distill.mix.general-low", "cell general-low has no teacher"),
        ("model.preset=huge", "model.preset", "unknown model preset 'huge'"),
    ],
    ids=["suite", "spec-dir", "base", "student", "teacher", "teacher-init", "unknown-architecture", "positions",
         "mix-without-teacher", "preset"],
)
def test_validate_opens_every_file_the_recipe_names(tmp_path, capsys, override, field, expected):
    override = override.format(**bad_checkpoints(tmp_path))
    assert run_cli("validate", TINY, override) == 2
    err = capsys.readouterr().err
    assert f"mopd validate: error: {TINY}: field `{field}`: " in err and expected in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_validate_refuses_learning_curves_read_on_test(capsys):
    curves = ["curves={suite: eval/tiny.yaml}", "distill.curve_every=4"]
    assert run_cli("validate", TINY, *curves) == 2  # `mopd run` would refuse it only after the recipe check
    err = capsys.readouterr().err
    assert f"{TINY}: field `curves.suite`: " in err and "tiny.yaml is a test suite" in err
    assert run_cli("validate", TINY, "curves={suite: eval/nowhere.yaml}", "distill.curve_every=4") == 2
    err = capsys.readouterr().err
    assert f"{TINY}: field `curves.suite`: " in err and "nowhere.yaml" in err and "Traceback" not in err
    assert run_cli("validate", TINY, "curves={suite: eval/tiny-dev.yaml}", "distill.curve_every=4") == 0


def test_a_spec_error_names_the_recipe_field_and_the_spec(tmp_path, capsys):
    (tmp_path / "teachers").mkdir()
    (tmp_path / "teachers" / "code-max.yaml").write_text("domain: code\neffort: max\n")
    assert run_cli("validate", TINY, f"teachers.spec_dir={tmp_path / 'teachers'}") == 2
    err = capsys.readouterr().err
    assert f"{TINY}: field `teachers.spec_dir`: " in err and "general-low.yaml: no such file" in err


def test_run_validates_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("run", TINY, "--out", str(out), "bench.suite=eval/does_not_exist.yaml") == 2
    err = capsys.readouterr().err
    assert f"mopd run: error: {TINY}: field `bench.suite`: eval/does_not_exist.yaml: no such file" in err
    assert "Traceback" not in err and not out.exists()


def test_a_ray_that_will_not_start_is_one_line_naming_where_and_how_to_resume(monkeypatch, capsys):
    import ray

    from mopd import cli, cluster

    def refuse(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet\nfailed")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(cluster.ClusterStartError, match=r"ray.address='ray://head:10001' \(The current node timed out"):
        cluster.connect_ray("ray://head:10001")
    monkeypatch.setattr(cli, "cmd_run", lambda args: cluster.start_ray(load_recipe(args.recipe, args.overrides)))
    assert run_cli("run", TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith("mopd run: error: could not start a local Ray node (The current node timed out during startup.")
    assert "re-run the same command to resume" in err and "Traceback" not in err and err.count("\n") == 1


def test_init_convert_without_arch_k3_is_refused_in_one_line_before_anything_is_read(tmp_path, capsys):
    """`--init convert` converts into a K3 hybrid: without `--arch k3` it is refused first, before the
    `--arch same` check for `--layers` and before the teacher (here: none) is opened."""
    out = tmp_path / "student"
    for arch in ([], ["--arch", "same"]):
        argv = ["init-student", "--from", str(tmp_path / "no-teacher"), "--out", str(out), "--init", "convert", *arch]
        assert run_cli(*argv, "--layers", "2") == 2
        assert capsys.readouterr().err == (
            "mopd init-student: error: --init convert needs --arch k3 "
            "(it converts the teacher into a K3 hybrid; --arch is same)\n"
        )
    assert run_cli("init-student", "--from", str(tmp_path / "no-teacher"), "--out", str(out), "--init", "convert") == 2
    assert "--init convert needs --arch k3" in capsys.readouterr().err  # not "--arch same needs --layers N"
    assert not out.exists()
    # with --arch k3 the combination passes, and the next thing checked is the teacher
    assert run_cli("init-student", "--from", str(tmp_path / "no-teacher"), "--out", str(out), "--arch", "k3", "--init", "convert") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mopd init-student: error: --from {tmp_path / 'no-teacher'}: ") and err.count("\n") == 1


def test_init_takes_only_random_or_convert(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli("init-student", "--from", str(tmp_path), "--out", str(tmp_path / "s"), "--arch", "k3", "--init", "copy")
    assert exit_.value.code == 2
    assert "argument --init: invalid choice: 'copy' (choose from 'random', 'convert')" in capsys.readouterr().err
