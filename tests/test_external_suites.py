"""External suites of `mopd bench`: HumanEval, BFCL and GSM-style word problems, judged as their
authors judge them, and shown right on their own data.

BFCL's own expected calls (every question of the four categories) pass our AST checker and planted
wrong calls fail; HumanEval's reference solutions pass in the bubblewrap sandbox and wrong ones,
early exits and an infinite loop fail; GSM answers pass in their usual surface forms. Suites refuse
what does not fit an external split, the audit refuses a run whose records hold their contents, and
`mopd bench` runs the three quick suites end to end on a tiny model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from mopd.bench.audit import audit_jobs, check_overlap
from mopd.bench.external import answer_of, external_env, without_thinking
from mopd.bench.external.bfcl_checker import CallError, check_calls, parse_calls
from mopd.bench.external.humaneval import LIMITS
from mopd.bench.external.sources import BFCL_CATEGORIES, bfcl_records, humaneval_problems
from mopd.bench.run import run_bench_stage
from mopd.bench.suite import BenchError, SuiteError, load_suite, select
from mopd.cli import main
from mopd.envs.base import Verdict
from mopd.envs.splits import TRAINED_ON, TRAINED_TEXT, write_trained_on
from mopd.envs.tokenizer import build_tiny_tokenizer
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.pipeline import StageContext
from mopd.recipe import Recipe
from mopd.rollout.episodes import Rollout

ROOT = Path(__file__).resolve().parents[1]
QUICK = ("humaneval", "bfcl", "gsm")


# ----------------------------------------------------------------------------- BFCL
def example_value(option):
    """A concrete value from one of BFCL's allowed values (a dict option maps keys to allowed lists)."""
    if isinstance(option, dict):
        return {k: example_value(vs[0]) for k, vs in option.items() if vs and vs[0] != ""}
    if isinstance(option, list):
        return [example_value(item) if isinstance(item, dict) else item for item in option]
    return option


def expected_text(task, reverse: bool = False) -> str:
    """BFCL's expected calls as a model would write them: `[f(a=1), g(b='x')]`, every parameter the
    function documents with its first allowed value other than "" (which marks one that may be left
    out; a few answers also list, as optional, a parameter the function does not have)."""
    calls = []
    for call in task.meta["ground_truth"]:
        (name, params), = call.items()
        documented = next(f for f in task.meta["functions"] if f["name"] == name)["parameters"]["properties"]
        given = {p: next(v for v in vs if v != "") for p, vs in params.items() if p in documented and any(v != "" for v in vs)}
        args = [f"{p}={example_value(v)!r}" for p, v in given.items()]
        calls.append(f"{name}({', '.join(args)})")
    return "[" + ", ".join(reversed(calls) if reverse else calls) + "]"


@pytest.fixture(scope="module")
def bfcl():
    return external_env("bfcl")


@pytest.mark.parametrize("category", BFCL_CATEGORIES)
def test_bfcls_own_expected_calls_all_pass_our_checker(bfcl, category):
    tasks = [t for t in bfcl.tasks("low") if t.meta["category"] == category]
    assert len(tasks) == {"simple_python": 400}.get(category, 200)
    failed = {t.id: bfcl.verify(t, expected_text(t)).details for t in tasks}
    assert {k: v for k, v in failed.items() if "reason" in v} == {}
    if "parallel" in category:  # parallel calls are taken in any order; like BFCL's, our checker matches
        # each expected call to the first unmatched call that fits it, so where one call fits two expected
        # ones (parallel_178: "Microsoft or Apple" in January, then Apple in January) the order matters
        shuffled = {t.id for t in tasks if not bfcl.verify(t, expected_text(t, reverse=True)).passed}
        assert shuffled <= {"bfcl-parallel_178"}


def test_the_suite_reads_bfcl_in_file_order_with_the_question_and_functions_in_the_prompt(bfcl):
    first = bfcl.tasks("high", limit=2)
    assert [t.id for t in first] == [f"bfcl-{c}_{i}" for c in BFCL_CATEGORIES for i in (0, 1)]
    task = first[0]
    assert task.prompt == "Find the area of a triangle with a base of 10 units and height of 5 units."
    assert '"name": "calculate_triangle_area"' in task.meta["system"] and "[func_name1(" in task.meta["system"]
    assert bfcl_records("simple_python")[0][1]["ground_truth"] == task.meta["ground_truth"]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('[calculate_triangle_area(base="10", height=5)]', "is not of type integer"),  # wrong type
        ("[calculate_triangle_area(height=5)]", "missing required parameter 'base'"),
        ("[calculate_triangle_area(base=10, height=5, colour='red')]", "unexpected parameter 'colour'"),
        ("[calculate_triangle_area(base=11, height=5)]", "is not one of [10]"),  # a value not allowed
        ("[calculate_triangle_area(base=10, height=5, unit='miles')]", "is not one of"),
        ("[triangle_area(base=10, height=5)]", "not called"),
        ("[calculate_triangle_area(base=10, height=5), calculate_triangle_area(base=10, height=5)]", "wrong number"),
    ],
)
def test_planted_wrong_calls_fail(bfcl, answer, why):
    task = bfcl.tasks("low", limit=1)[0]
    assert bfcl.verify(task, "[calculate_triangle_area(base=10, height=5, unit='units')]").passed
    verdict = bfcl.verify(task, answer)
    assert not verdict.passed and why in verdict.details["reason"]


def test_a_parallel_answer_needs_every_expected_call_once(bfcl):
    task = next(t for t in bfcl.tasks("low", limit=1) if t.meta["category"] == "parallel")
    right = expected_text(task)
    assert bfcl.verify(task, right).passed
    first = right[1:-1].split("), ")[0] + ")"
    verdict = bfcl.verify(task, f"[{first}, {first}]")  # the right count, one call twice
    assert not verdict.passed and "no call matches" in verdict.details["reason"]


def test_answers_that_are_not_calls_are_refused_with_the_reason():
    assert parse_calls("math.factorial(number=5)") == [{"math.factorial": {"number": 5}}]
    assert parse_calls("```\n[f(a=(1, 2), b={'k': -1.5})]\n```") == [{"f": {"a": [1, 2], "b": {"k": -1.5}}}]
    for text, why in [("The area is 25.", "not Python"), ("[1, 2]", "not a list of function calls"), ("[f(5)]", "positional")]:
        with pytest.raises(CallError, match=why):
            parse_calls(text)


def test_an_int_passes_for_a_documented_float_as_in_bfcl():
    functions = [{"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "float"}}, "required": ["x"]}}]
    assert check_calls(functions, [{"f": {"x": 5}}], [{"f": {"x": [5.0]}}], "simple") == (True, "")
    assert not check_calls(functions, [{"f": {"x": "5"}}], [{"f": {"x": [5.0]}}], "simple")[0]


# ----------------------------------------------------------------------------- HumanEval
@pytest.fixture(scope="module")
def humaneval():
    env = external_env("humaneval")
    yield env
    env.close()


def test_every_humaneval_reference_solution_passes_in_the_sandbox(humaneval):
    problems = humaneval_problems()
    tasks = humaneval.tasks("low")
    assert len(tasks) == 164 and [t.meta["task_id"] for t in tasks] == [p["task_id"] for p in problems]
    bodies = humaneval.verify_many(tasks, [p["canonical_solution"] for p in problems])  # the body after the prompt
    assert [t.id for t, v in zip(tasks, bodies, strict=True) if not v.passed] == []
    assert {v.details["sandbox"] for v in bodies} == {"bwrap"}


def test_a_whole_function_in_a_fence_after_thinking_passes(humaneval):
    problem, task = humaneval_problems()[2], humaneval.tasks("max", limit=3)[2]
    whole = f"<think>truncate: x % 1.0</think>Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```"
    assert humaneval.verify(task, whole).passed
    bare = f"def {problem['entry_point']}(number: float) -> float:\n    return number % 1.0\n"  # no fence, no prompt
    assert humaneval.verify(task, bare).passed
    assert humaneval.verify(task, "```python\n" + bare).passed  # a fence the token limit cut before it closed


@pytest.mark.parametrize(
    ("completion", "status"),
    [
        ("    return None\n", "exited"),  # wrong
        ("    return number\n", "exited"),  # wrong
        ("import os\nos._exit(0)\n", "exited"),  # exits before the test, status 0
        ("    raise SystemExit(0)\n", "exited"),
        ("<think>no end to this thought", None),  # never closed its thinking: nothing runs
    ],
)
def test_wrong_solutions_and_early_exits_fail(humaneval, completion, status):
    task = humaneval.tasks("low", limit=3)[2]  # truncate_number
    verdict = humaneval.verify(task, completion)
    assert not verdict.passed and verdict.details.get("status") == status


def test_an_infinite_loop_is_killed_by_the_sandboxs_time_limit(humaneval):
    task = humaneval.tasks("low", limit=1)[0]
    began = time.monotonic()
    verdict = humaneval.verify(task, "    while True:\n        pass\n")
    assert not verdict.passed and time.monotonic() - began < LIMITS.wall_s + 5
    assert verdict.details["status"] == "timeout" or verdict.details["returncode"] != 0  # wall clock or CPU limit


# ----------------------------------------------------------------------------- GSM
@pytest.fixture(scope="module")
def gsm_task():
    task = external_env("gsm", seed=0, size=5).tasks("high", limit=1)[0]
    return task.__class__(task.id, task.domain, task.effort, task.prompt, {**task.meta, "answer": "1000"})


@pytest.mark.parametrize(
    "answer",
    ["1000", "The answer is 1000.", "$1,000", "1000.0", r"so the total is \boxed{1000}", "1000 apples",
     "Answer: 1000\n", "400 + 600 = 1000", "<think>400+600</think>1,000.00", "2000/2"],
)
def test_gsm_answers_in_several_surface_forms_are_accepted(gsm_task, answer):
    assert external_env("gsm").verify(gsm_task, answer).passed, answer


@pytest.mark.parametrize("answer", ["999", "1000 apples and 5 pears: 1005", "one thousand", "<think>1000", "10000"])
def test_gsm_takes_the_final_number_only(gsm_task, answer):
    assert not external_env("gsm").verify(gsm_task, answer).passed, answer


def test_gsm_problems_are_the_generators_in_order():
    import reasoning_gym

    tasks = external_env("gsm", seed=0, size=200).tasks("low", limit=3)
    data = reasoning_gym.create_dataset("gsm_symbolic", size=200, seed=0)
    assert [t.meta["answer"] for t in tasks] == [str(data[i]["answer"]) for i in range(3)]
    assert [t.id for t in tasks] == ["gsm-0-0", "gsm-0-1", "gsm-0-2"] and data[0]["question"] in tasks[0].prompt


# ----------------------------------------------------------------------------- thinking
def test_a_model_that_writes_no_think_block_answers_without_thinking():
    assert answer_of("42<|end|>") == "42" and answer_of("<think>hm</think>\n42") == "42" and answer_of("<think>hm") is None
    assert answer_of("<think>hm</think>\n    return 1\n") == "    return 1"  # a body keeps its indentation
    rollout = Rollout(task=None, prompt_ids=[], turns=[{"role": "assistant", "content": "[f(a=1)]"}], verdict=Verdict(1.0),
                      thinking_tokens=9, over_budget=True)  # fmt: skip
    without_thinking(rollout)
    assert (rollout.thinking_tokens, rollout.answer_tokens, rollout.over_budget, rollout.reward) == (0, 9, False, 1.0)
    thought = Rollout(task=None, prompt_ids=[], turns=[{"role": "assistant", "content": "<think>long"}], verdict=Verdict(0.0),
                      thinking_tokens=99, over_budget=True)  # fmt: skip
    without_thinking(thought)
    assert thought.over_budget and thought.thinking_tokens == 99


# ----------------------------------------------------------------------------- suites and the audit
@pytest.mark.parametrize("name", ["humaneval", "bfcl", "gsm"])
def test_the_external_suites_load_and_their_quick_variants_take_a_limit(name):
    suite, quick = load_suite(ROOT / "eval" / f"{name}.yaml"), load_suite(ROOT / "eval" / f"{name}-quick.yaml")
    assert suite.split == quick.split == "external" and suite.limit is None and quick.limit == 2
    assert list(suite.domains) == [name] and suite.efforts == ["low", "high", "max"]
    assert select(suite, limit=5).limit == 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": 4}, "field `n`: Value error, an external suite asks every problem once"),
        ({"domains": {"code": {}}}, "field `domains`: Value error, unknown domains ['code']; choose some of ['humaneval', 'bfcl', 'gsm']"),
        ({"domains": {"humaneval": {"options": {"colour": 1}}}}, "domains.humaneval"),
        ({"limit": 0}, "field `limit`"),
    ],
)
def test_bad_external_suites_are_named_errors(tmp_path, change, message):
    data = {"name": "x", "split": "external", "domains": {"humaneval": {}}, **change}
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SuiteError, match=r"x\.yaml") as err:
        load_suite(tmp_path / "x.yaml")
    assert message in str(err.value)


def test_limit_is_for_external_suites_and_n_for_generated_ones():
    with pytest.raises(SuiteError, match=r"--limit: .* is a test suite"):
        select(load_suite(ROOT / "eval" / "tiny.yaml"), limit=3, source="eval/tiny.yaml")
    with pytest.raises(SuiteError, match=r"--n: .* is an external suite"):
        select(load_suite(ROOT / "eval" / "gsm.yaml"), n=3, source="eval/gsm.yaml")
    generated = {"name": "x", "split": "test", "seeds": [1], "limit": 3, "domains": {"general": {}}}
    with pytest.raises(ValueError, match="tasks per cell and seed: required"):
        load_suite_from(generated)


def load_suite_from(data: dict):
    from mopd.bench.suite import Suite

    return Suite.model_validate(data)


def fake_run(root: Path, teacher_holds: set[str]) -> Path:
    """A run directory with a base and one teacher, each with both training records."""
    (root / "recipe.json").parent.mkdir(parents=True)
    (root / "recipe.json").write_text("{}")
    for stage, keys in (("base", set()), ("teachers/code-high", teacher_holds)):
        (root / stage / "config.json").parent.mkdir(parents=True)
        (root / stage / "config.json").write_text("{}")
        write_trained_on(root / stage, keys, TRAINED_ON)
        write_trained_on(root / stage, set(), TRAINED_TEXT)
    return root


def test_the_audit_refuses_a_run_whose_records_hold_an_external_problem(tmp_path, humaneval):
    tasks = humaneval.tasks("low", limit=3)
    leaked = fake_run(tmp_path / "leaked", {tasks[1].meta["content_hash"]})
    jobs = [("base", leaked / "base", "humaneval-low", tasks)]
    audits = audit_jobs(jobs, whole_run=True)  # the base's own lineage never saw it: the teacher's record did
    assert audits["base", "humaneval-low"]["overlap"] == 1 and audits["base", "humaneval-low"]["stages"]["teachers/code-high"] == 1
    with pytest.raises(BenchError, match="external suite, but some of its tasks were trained on"):
        check_overlap(audits, "external", allow=False, source="eval/humaneval.yaml")
    clean = fake_run(tmp_path / "clean", set())
    audits = audit_jobs([("base", clean / "base", "humaneval-low", tasks)], whole_run=True)
    assert audits["base", "humaneval-low"]["overlap"] == 0
    assert not check_overlap(audits, "external", allow=False, source="eval/humaneval.yaml")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = build_tiny_tokenizer(tasks_per_cell=10)
    torch.manual_seed(0)
    model = K3HybridForCausalLM(preset_config("tiny", vocab_size=len(tokenizer), num_hidden_layers=2))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|end|>", "<|eos|>"])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def quick_suite(name: str, tmp_path: Path) -> Path:
    """The repository's quick suite; BFCL's simple category only: the tiny byte-level tokenizer makes
    the other categories' function lists longer than the HF backend's 2,048-token context."""
    if name != "bfcl":
        return ROOT / "eval" / f"{name}-quick.yaml"
    data = yaml.safe_load((ROOT / "eval" / "bfcl-quick.yaml").read_text())
    data["domains"]["bfcl"]["options"]["categories"] = ["simple_python"]
    (tmp_path / "bfcl-simple.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "bfcl-simple.yaml"


def test_the_external_audit_line_tells_a_run_without_a_record_from_a_model_outside_any_run():
    from mopd.bench.run import external_audit_line

    audits = {
        "student": {"tasks": 4, "distinct": 4, "overlap": 0, "stages": {}},
        "teacher": {"tasks": 4, "distinct": 4, "unavailable": "distill wrote no training record", "missing_record": True},
        "smollm2": {"tasks": 4, "distinct": 4, "unavailable": "not a mopd run"},
    }
    line = external_audit_line([{"model": m, "audit": a} for m, a in audits.items()])
    assert "none of their contents in any training record of the run of student" in line
    assert "the run of teacher lacks a stage's training record" in line
    assert "smollm2 is not from a mopd run" in line and "teacher is not from" not in line


@pytest.mark.parametrize("name", QUICK)
def test_mopd_bench_runs_each_quick_external_suite_and_reports_the_audit(tiny_model, tmp_path, name):
    out = tmp_path / name
    argv = ["bench", str(tiny_model), "--suite", str(quick_suite(name, tmp_path)), "--backend", "hf", "--out", str(out),
            "--limit", "1"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["suite"]["split"] == "external" and report["suite"]["limit"] == 1
    rows = report["results"]
    assert [(r["domain"], r["effort"], r["tasks"]) for r in rows] == [(name, "low", 1)]
    assert 0.0 <= rows[0]["accuracy"] <= 1.0 and rows[0]["budget_tokens"] == 16
    text = (out / "report.md").read_text()
    assert "External suite: no training stage drew these problems" in text and "is not from a mopd run" in text
    assert f"| {name}/low |" in text and "problems per cell (the first 1 of each source" in text
    assert "tasks that any stage of the model's run trained on" in text


def tiny_run(tmp_path: Path, tiny_model: Path) -> tuple[Path, Recipe]:
    """A run of the tiny model: its base with both (empty) training records, a recipe whose bench
    takes a one-cell test suite (n: 1) and the quick GSM suite as an external one."""
    one_cell = tmp_path / "one_cell.yaml"
    one_cell.write_text(yaml.safe_dump({"name": "unit", "split": "test", "seeds": [1001], "n": 2, "temperature": 0.0,
                                        "efforts": ["low"], "domains": {"general": {"families": ["add"]}}}))  # fmt: skip
    efforts = {e: {"budget_tokens": 4, "answer_tokens": 4} for e in ("low", "high", "max")}
    bench = {"suite": str(one_cell), "n": 1, "external": [str(ROOT / "eval" / "gsm-quick.yaml")], "backend": "hf"}
    recipe = Recipe(name="unit", efforts=efforts, bench=bench)
    run = tmp_path / "run"
    shutil.copytree(tiny_model, run / "base")
    (run / "recipe.json").write_text(recipe.model_dump_json())
    for record in (TRAINED_ON, TRAINED_TEXT):
        write_trained_on(run / "base", set(), record)
    return run, recipe


def test_mopd_bench_run_with_an_external_suite_reports_beside_the_runs_own(tiny_model, tmp_path):
    run, _ = tiny_run(tmp_path, tiny_model)
    assert main(["bench", "--run", str(run), "--suite", str(ROOT / "eval" / "gsm-quick.yaml"), "--limit", "1"]) == 0
    report = json.loads((run / "bench" / "gsm-quick" / "report.json").read_text())
    assert [(r["model"], r["tasks"], r["audit"]["overlap"]) for r in report["results"]] == [("base", 1, 0)]
    assert not (run / "bench" / "report.json").exists()  # the run's own report is not overwritten


def test_the_bench_stage_runs_the_recipes_external_suites_beside_its_test_suite(tiny_model, tmp_path):
    run, recipe = tiny_run(tmp_path, tiny_model)
    compute = run_bench_stage(StageContext(recipe, run, run / "bench", {"base": run / "base"}))
    tiny = json.loads((run / "bench" / "report.json").read_text())
    gsm = json.loads((run / "bench" / "gsm-quick" / "report.json").read_text())
    assert tiny["suite"]["name"] == "unit" and tiny["results"][0]["tasks"] == 1 and gsm["suite"]["name"] == "gsm-quick"
    assert [(r["model"], r["domain"], r["tasks"], r["audit"]["overlap"]) for r in gsm["results"]] == [("base", "gsm", 2, 0)]
    assert "found none of their contents in any training record of the run of base" in gsm["audit_line"]
    assert compute["tokens_sampled"] == sum(
        round(r["generated_tokens_mean"] * r["tasks"]) for report in (tiny, gsm) for r in report["results"]
    )


def test_validate_checks_a_recipes_external_suites(capsys):
    assert main(["validate", str(ROOT / "recipes" / "k3-gpu.yaml")]) == 0
    assert main(["validate", str(ROOT / "recipes" / "k3-gpu.yaml"), "bench.external=[eval/tiny.yaml]"]) == 2
    err = capsys.readouterr().err
    assert "field `bench.external[0]`: eval/tiny.yaml is a test suite; external suites declare `split: external`" in err
