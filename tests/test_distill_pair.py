"""Pair distillation on CPU: the per-token KL falls and the student's reward rises toward its teacher's.

The teacher is the base after more supervised steps on the cell's tasks (a fake teacher: better
than the base on its cell, same tokenizer). The student is the base; it learns only from the
teacher's per-token scores of its own samples.
"""

import json
from statistics import fmean

import pytest
import torch
from transformers import AutoTokenizer

from mopd.distill.fakes import EASY_ENV_OPTIONS, sft_on_tasks
from mopd.distill.pair import distill_pair
from mopd.distill.trainer import TaskFileEnv
from mopd.envs import get_env
from mopd.envs.data import load_task_file
from mopd.envs.effort import default_effort_specs
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import run_rollouts

STEPS = 48


def mean_reward(model_dir, tasks, samples=4):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = create_engine(model_dir, backend="hf")
    groups = run_rollouts(engine, tokenizer, {"general": TaskFileEnv()}, tasks, default_effort_specs(), n=samples, seed=1)
    return fmean(r.reward for group in groups for r in group)


@pytest.fixture(scope="module")
def cell(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("pair")
    env = get_env("general", **EASY_ENV_OPTIONS["general"])
    tasks = env.sample(8, seed=7, split="train", effort="low")
    data = root / "cell.jsonl"
    data.write_text("".join(json.dumps({"id": t.id, "prompt": t.prompt, "effort": t.effort, "meta": t.meta}) + "\n" for t in tasks))
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=4, vocab_size=len(tiny_tokenizer))).save_pretrained(root / "init")
    tiny_tokenizer.save_pretrained(root / "init")
    base = sft_on_tasks(root / "init", root / "base", tasks, env.solve, steps=25, batch_size=8)
    teacher = sft_on_tasks(base, root / "teacher", tasks, env.solve, steps=60, batch_size=8, seed=1)
    return root, data, base, teacher


def test_pair_distillation_lowers_the_kl_and_raises_the_reward_toward_the_teacher(cell):
    root, data, base, teacher = cell
    tasks = load_task_file(data, "general")
    before, teacher_reward = mean_reward(base, tasks), mean_reward(teacher, tasks)
    assert teacher_reward > before + 0.3  # a teacher worth distilling

    student = distill_pair(
        teacher, base, root / "student", data_file=data, verifier="general",
        steps=STEPS, prompts_per_step=32, learning_rate=1e-3, checkpoint_every=STEPS, progress=False,
    )  # fmt: skip
    after = mean_reward(student, tasks)
    curve = [json.loads(line) for line in (root / "student" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["reverse_kl"] for r in curve]
    third = STEPS // 3
    print(f"pair: reward base {before:.3f} → student {after:.3f} (teacher {teacher_reward:.3f}); "
          f"KL per step {[round(k, 3) for k in kl]}")  # fmt: skip
    assert fmean(kl[-third:]) < 0.85 * fmean(kl[:third])
    assert after > before + 0.1
    assert after <= teacher_reward + 0.1  # toward the teacher, not past it (reward scale 1)


def test_pair_command_reports_a_missing_teacher_in_one_line(cell, capsys):
    from mopd.distill.pair import main

    root, data, base, _ = cell
    argv = ["distill", "--teacher", str(root / "no-teacher"), "--student", str(base), "--out", str(root / "x"), "--data", str(data)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mopd distill: error: teacher of general-low checkpoint") and "no-teacher does not exist" in err
    assert not (root / "x").exists()
