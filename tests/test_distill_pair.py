"""Pair distillation on CPU, through `mopd distill` with its defaults (vLLM, the schema's loss): the
per-token KL falls on the train rows, the held-out rows are never trained on, and eval.json scores
the student before, after and the teacher on the dev rows (test rows only with `--eval-split test`).

The teacher is the base after more supervised steps on every row of the task file (a fake teacher:
better than the base on them, same tokenizer). The student is the base; it learns only from the
teacher's per-token scores of its own samples, on the train rows. These tiny models memorise
sums rather than learn to add, so the student's held-out reward is reported here, not asserted
to rise.
"""

import json
from pathlib import Path
from statistics import fmean

import pytest
import torch

import mopd.distill.pair
import mopd.distill.trainer
from mopd.distill.pair import PairError, add_distill_parser, distill_pair, eval_line, main, pair_tasks
from mopd.envs import get_env
from mopd.envs.splits import read_trained_on, split_of
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import DistillSpec, load_recipe
from tests.fakes import EASY_ENV_OPTIONS, sft_on_tasks

ROOT = Path(__file__).resolve().parent.parent
STEPS = 32
HELD_OUT = 8
SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def _real_set_num_threads(monkeypatch):
    """`mopd distill` pins torch threads; vLLM's in-process worker of an earlier test replaced the function
    with one that only logs a warning (as conftest explains), which would land in these tests' stderr."""
    monkeypatch.setattr(torch, "set_num_threads", SET_NUM_THREADS)


def split_tasks(splits=("train", "dev", "test")) -> dict[str, list]:
    """Tasks of general-low (easy sums) per split: 8 train, HELD_OUT dev and HELD_OUT test."""
    env = get_env("general", **EASY_ENV_OPTIONS["general"])
    return {split: env.sample(8 if split == "train" else HELD_OUT, seed=7, split=split, effort="low") for split in splits}


def write_task_file(path, tasks) -> str:
    rows = [{"id": t.id, "prompt": t.prompt, "effort": t.effort, "meta": t.meta} for t in tasks]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def cell(tmp_path_factory, tiny_tokenizer):
    """A task file of train, dev and test rows; a base SFT'd on the train rows, a teacher on the train and dev rows."""
    root = tmp_path_factory.mktemp("pair")
    env = get_env("general", **EASY_ENV_OPTIONS["general"])
    tasks = split_tasks()
    data = root / "cell.jsonl"
    write_task_file(data, tasks["train"] + tasks["dev"] + tasks["test"])
    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=4, vocab_size=len(tiny_tokenizer))).save_pretrained(root / "init")
    tiny_tokenizer.save_pretrained(root / "init")
    base = sft_on_tasks(root / "init", root / "base", tasks["train"], env.solve, steps=25, batch_size=8)
    teacher = sft_on_tasks(base, root / "teacher", tasks["train"] + tasks["dev"], env.solve, steps=60, batch_size=8, seed=1)
    keys = {split: {t.meta["content_hash"] for t in tasks[split]} for split in ("dev", "test")}
    return root, data, base, teacher, keys


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
    assert report["tasks"] == HELD_OUT and report["held_out"] == f"dev-split rows of {data}, by content key"
    assert report["split"] == "dev" and set(report["task_keys"]) == held_out_keys["dev"]  # dev by default, no test row
    assert all(split_of(key) == "dev" for key in report["task_keys"])
    assert f"on {HELD_OUT} dev-split tasks (dev-split rows of {data}, by content key)" in printed
    assert f"student before {before:.3f}, after {after:.3f}" in printed and f"teacher {teacher_reward:.3f}" in printed
    assert diff["mean"] == pytest.approx(after - before) and diff["low"] <= diff["mean"] <= diff["high"]

    trained_on = read_trained_on(out)
    assert trained_on and not trained_on & (held_out_keys["dev"] | held_out_keys["test"])  # held-out rows never trained on
    assert all(split_of(key) == "train" for key in trained_on)

    kl = [json.loads(line)["reverse_kl"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    third = STEPS // 3
    assert fmean(kl[-third:]) < 0.85 * fmean(kl[:third])
    assert teacher_reward > before + 0.2  # the eval tells the models apart


def distill_parser():
    import argparse

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_distill_parser(subparsers)
    return subparsers.choices["distill"]


def distill_args(*extra: str):
    return distill_parser().parse_args(["--teacher", "t", "--student", "s", "--out", "o", *extra])


def test_pair_defaults_are_the_schemas():
    args = distill_args()
    schema = DistillSpec()
    assert (args.steps, args.prompts_per_step, args.learning_rate) == (schema.steps, schema.prompts_per_step, schema.learning_rate)
    assert args.full_vocab_kl == schema.full_vocab_kl
    assert (args.importance, args.importance_low, args.importance_high) == (schema.importance.mode, schema.importance.low, schema.importance.high)
    assert args.backend is None and args.threads == 1  # None: vLLM wherever it is installed
    assert (args.seed, args.eval_split, args.eval_tasks) == (0, "dev", 32)


def test_each_training_default_names_its_source_and_what_recipes_tiny_sets():
    """The help names the schema default it shows and recipes/tiny.yaml's value (a number, or "the same"), and
    both are true of DistillSpec and of tiny's distill block."""
    import re
    from operator import attrgetter

    parser = distill_parser()
    helps = {action.dest: action.help for action in parser._actions}
    tiny, schema = load_recipe(ROOT / "recipes" / "tiny.yaml").distill, DistillSpec()
    fields = {"steps": "steps", "prompts_per_step": "prompts_per_step", "learning_rate": "learning_rate",
              "full_vocab_kl": "full_vocab_kl", "importance": "importance.mode", "importance_low": "importance.low",
              "importance_high": "importance.high"}  # fmt: skip
    for dest, field in fields.items():
        value = attrgetter(field)
        assert "default %(default)s: the schema's DistillSpec default" in helps[dest], dest  # the number: argparse's
        stated = re.search(r"recipes/tiny.yaml sets (.+)\)$", helps[dest])[1]
        if stated == "the same":
            assert value(tiny) == value(schema), dest
        else:
            assert float(stated) == value(tiny) != value(schema), dest
    shown = " ".join(parser.format_help().split())
    assert "default 0.0001: the schema's DistillSpec default, not a recipe's (recipes/tiny.yaml sets 3e-4)" in shown


def test_the_held_out_draw_is_the_dev_split_by_default_and_test_on_request(tmp_path):
    tasks = split_tasks()
    data = write_task_file(tmp_path / "tasks.jsonl", tasks["train"] + tasks["test"] + tasks["dev"])
    train, held_out, cells = pair_tasks(None, None, data, "general", {}, 32, 0)
    assert cells == ["general-low"] and {split_of(t.meta["content_hash"]) for t in train} == {"train"}
    assert [t.meta["content_hash"] for t in held_out] == [t.meta["content_hash"] for t in tasks["dev"]]
    _, held_out, _ = pair_tasks(None, None, data, "general", {}, 3, 0, "test")
    assert [t.meta["content_hash"] for t in held_out] == [t.meta["content_hash"] for t in tasks["test"][:3]]

    for split in ("dev", "test"):  # a domain's cell: drawn from the environment's split
        _, held_out, cells = pair_tasks("general", "low", None, None, EASY_ENV_OPTIONS, 6, 0, split)
        assert cells == ["general-low"] and len(held_out) == 6
        assert {split_of(t.meta["content_hash"]) for t in held_out} == {split}
    _, default, _ = pair_tasks("general", "low", None, None, EASY_ENV_OPTIONS, 6, 0)
    assert {split_of(t.meta["content_hash"]) for t in default} == {"dev"}


def test_a_task_file_without_rows_of_the_eval_split_skips_the_eval_and_says_which(tmp_path):
    tasks = split_tasks()
    data = write_task_file(tmp_path / "tasks.jsonl", tasks["train"] + tasks["test"])
    assert pair_tasks(None, None, data, "general", {}, 32, 0)[1] == []  # no dev row: nothing held out
    assert len(pair_tasks(None, None, data, "general", {}, 32, 0, "test")[1]) == HELD_OUT
    assert eval_line(tmp_path / "eval.json", 32, "dev") == (
        "held-out eval skipped: no task is held out (no row of the task file is in the dev split, by content key)"
    )
    with pytest.raises(PairError, match="eval split 'train': choose dev or test"):
        distill_pair("t", "s", tmp_path / "out", data_file=data, eval_split="train")


@pytest.mark.parametrize(("extra", "seed", "split"), [([], 0, "dev"), (["--seed", "3", "--eval-split", "test"], 3, "test")])
def test_seed_and_eval_split_reach_the_run_and_the_line_names_the_split(tmp_path, capsys, monkeypatch, extra, seed, split):
    calls = []

    def fake_distill_pair(teacher, student, out_dir, **kwargs):
        calls.append(kwargs)
        report = {"held_out": f"{kwargs['eval_split']} split of general-low", "split": kwargs["eval_split"], "tasks": 2,
                  "student_before": {"reward": 0.25}, "student_after": {"reward": 0.5}, "teacher": {"reward": 0.75},
                  "after_minus_before": {"mean": 0.25, "low": None, "high": None}}  # fmt: skip
        (tmp_path / "eval.json").write_text(json.dumps(report))
        return tmp_path / "model"

    monkeypatch.setattr(mopd.distill.pair, "distill_pair", fake_distill_pair)
    argv = ["distill", "--teacher", "t", "--student", "s", "--out", str(tmp_path), "--domain", "general", "--effort", "low", *extra]
    assert main(argv) == 0
    assert calls[0]["seed"] == seed and calls[0]["eval_split"] == split
    assert f"held-out reward on 2 {split}-split tasks ({split} split of general-low)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        distill_args("--eval-split", "train")


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
