"""Pair distillation on CPU, through `mopd distill` with its defaults (vLLM, the recipe's loss): the
per-token KL falls on the train rows, the held-out rows are never trained on, and eval.json scores
the student before, after and the teacher on them.

The teacher is the base after more supervised steps on every row of the task file (a fake teacher:
better than the base on them, same tokenizer). The student is the base; it learns only from the
teacher's per-token scores of its own samples, on the train rows. These tiny models memorise
sums rather than learn to add, so the student's held-out reward is reported here, not asserted
to rise.
"""

import json
from statistics import fmean

import pytest
import torch

import mopd.distill.trainer
from mopd.distill.pair import add_distill_parser, main
from mopd.envs import get_env
from mopd.envs.splits import read_trained_on, split_of
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec
from tests.fakes import EASY_ENV_OPTIONS, sft_on_tasks

STEPS = 32
HELD_OUT = 8
SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def _real_set_num_threads(monkeypatch):
    """`mopd distill` pins torch threads; vLLM's in-process worker of an earlier test replaced the function
    with one that only logs a warning (as conftest explains), which would land in these tests' stderr."""
    monkeypatch.setattr(torch, "set_num_threads", SET_NUM_THREADS)


@pytest.fixture(scope="module")
def cell(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("pair")
    env = get_env("general", **EASY_ENV_OPTIONS["general"])
    train = env.sample(8, seed=7, split="train", effort="low")
    held_out = env.sample(HELD_OUT, seed=7, split="test", effort="low")
    data = root / "cell.jsonl"
    rows = [{"id": t.id, "prompt": t.prompt, "effort": t.effort, "meta": t.meta} for t in train + held_out]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=4, vocab_size=len(tiny_tokenizer))).save_pretrained(root / "init")
    tiny_tokenizer.save_pretrained(root / "init")
    base = sft_on_tasks(root / "init", root / "base", train, env.solve, steps=25, batch_size=8)
    teacher = sft_on_tasks(base, root / "teacher", train + held_out, env.solve, steps=60, batch_size=8, seed=1)
    return root, data, base, teacher, {t.meta["content_hash"] for t in held_out}


def test_pair_command_distils_on_train_rows_and_reports_held_out_rewards(cell, capsys, monkeypatch):
    root, data, base, teacher, held_out_keys = cell
    backends = []
    create_engine = mopd.distill.trainer.create_engine
    monkeypatch.setattr(mopd.distill.trainer, "create_engine", lambda path, backend, **kw: backends.append(backend) or create_engine(path, backend, **kw))
    out = root / "student"
    argv = ["distill", "--teacher", str(teacher), "--student", str(base), "--out", str(out), "--data", str(data),
            "--verifier", "general", "--steps", str(STEPS), "--prompts-per-step", "32", "--learning-rate", "1e-3"]  # fmt: skip
    assert main(argv) == 0
    assert backends == ["vllm"]  # the default wherever vLLM is installed

    report = json.loads((out / "eval.json").read_text())
    before, after, teacher_reward = (report[name]["reward"] for name in ("student_before", "student_after", "teacher"))
    diff = report["after_minus_before"]
    printed = capsys.readouterr().out
    print(printed, report)
    assert report["tasks"] == HELD_OUT and report["held_out"] == f"rows of {data} outside the train split"
    assert f"student before {before:.3f}, after {after:.3f}" in printed and f"teacher {teacher_reward:.3f}" in printed
    assert diff["mean"] == pytest.approx(after - before) and diff["low"] <= diff["mean"] <= diff["high"]

    trained_on = read_trained_on(out)
    assert trained_on and not trained_on & held_out_keys  # held-out rows are never trained on
    assert all(split_of(key) == "train" for key in trained_on)

    kl = [json.loads(line)["reverse_kl"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    third = STEPS // 3
    assert fmean(kl[-third:]) < 0.85 * fmean(kl[:third])
    assert teacher_reward > before + 0.2  # the eval tells the models apart


def test_pair_defaults_are_the_recipes():
    import argparse

    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers())
    args = parser.parse_args(["distill", "--teacher", "t", "--student", "s", "--out", "o"])
    recipe = DistillSpec()
    assert (args.steps, args.prompts_per_step, args.learning_rate) == (recipe.steps, recipe.prompts_per_step, recipe.learning_rate)
    assert args.full_vocab_kl == recipe.full_vocab_kl
    assert (args.importance, args.importance_low, args.importance_high) == (recipe.importance.mode, recipe.importance.low, recipe.importance.high)
    assert args.backend is None and args.threads == 1  # None: vLLM wherever it is installed


def test_pair_command_reports_a_missing_teacher_in_one_line(cell, capsys):
    root, data, base, _, _ = cell
    argv = ["distill", "--teacher", str(root / "no-teacher"), "--student", str(base), "--out", str(root / "x"), "--data", str(data)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mopd distill: error: teacher of general-low checkpoint") and "no-teacher does not exist" in err
    assert not (root / "x").exists()


def test_pair_command_reports_a_bad_loss_option_in_one_line(cell, capsys):
    root, data, base, teacher, _ = cell
    argv = ["distill", "--teacher", str(teacher), "--student", str(base), "--out", str(root / "y"), "--data", str(data),
            "--importance-low", "0"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mopd distill: error: mopd distill: field `importance.low`") and len(err.splitlines()) == 1
