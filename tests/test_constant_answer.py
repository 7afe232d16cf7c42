"""`benchmarks.constant_answer`: a model whose agent rewards are those of one constant answer is found out."""

import json
from collections import Counter

from benchmarks.constant_answer import main
from mopd.envs import get_env
from mopd.envs.agent.env import question_answer
from mopd.recipe import load_recipe

RECIPE = "recipes/smollm2.yaml"


def test_rewards_of_a_constant_answer_match_on_every_task(tmp_path):
    suite = {"n": 16, "seeds": [1001], "split": "test", "samples": 1, "efforts": ["max"]}
    tasks = get_env("agent", **load_recipe(RECIPE).env_options("agent")).sample(16, 1001, "test", "max")
    answers = [question_answer(task.meta) for task in tasks]
    common, count = Counter(answers).most_common(1)[0]
    keys = [task.meta["content_hash"] for task in tasks]
    rows = [  # always says the common answer; always right
        {"model": "constant", "domain": "agent", "effort": "max", "accuracy": count / 16, "task_keys": keys,
         "task_rewards": [float(a == common) for a in answers]},
        {"model": "perfect", "domain": "agent", "effort": "max", "accuracy": 1.0, "task_keys": keys, "task_rewards": [1.0] * 16},
    ]  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps({"suite": suite, "results": rows}))
    assert main(["--recipe", RECIPE, "--report", str(tmp_path / "report.json"), "--out", str(tmp_path / "out.json")]) == 0
    cell = json.loads((tmp_path / "out.json").read_text())["cells"]["agent-max"]
    assert cell["majority"] == {"answer": common, "share": count / 16, "tasks": 16}
    assert cell["models"]["constant"]["matches"] == 16
    assert cell["models"]["perfect"]["matches"] == count  # right where the constant is, and elsewhere too
