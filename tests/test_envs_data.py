"""Tasks as datasets.Dataset, users' JSONL/parquet task files, and verifiers chosen by name."""

import json

import datasets
import pytest

from mopd.envs import get_env
from mopd.envs.base import DOMAINS, Task, Verdict
from mopd.envs.data import (
    TaskFileError,
    dataset_to_tasks,
    get_verifier,
    load_task_file,
    register_verifier,
    tasks_to_dataset,
    verify_task,
)
from mopd.envs.splits import content_hash

ROWS = [
    {"prompt": "What is 6 times 7?", "answer": "42"},
    {"id": "capital", "prompt": "Capital of France?", "answer": "Paris", "effort": "low", "source": "quiz"},
    {"prompt": "Sum of 1,000 and 234?", "answer": "1,234", "meta": {"level": 2}},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def domain_tasks():
    return {domain: get_env(domain).sample(4, seed=0, effort="high") for domain in DOMAINS}


def test_tasks_of_every_domain_survive_a_parquet_round_trip_and_still_verify(domain_tasks, tmp_path):
    tasks = [t for domain in DOMAINS for t in domain_tasks[domain]]
    dataset = tasks_to_dataset(tasks)
    assert isinstance(dataset, datasets.Dataset) and len(dataset) == len(tasks)
    dataset.to_parquet(tmp_path / "tasks.parquet")
    back = dataset_to_tasks(datasets.Dataset.from_parquet(str(tmp_path / "tasks.parquet")))
    assert back == tasks
    for task in back[:: len(domain_tasks["general"])]:
        env = get_env(task.domain)
        assert verify_task(task, env.solve(task)).reward == 1.0, task.id


def test_a_users_jsonl_file_with_a_verifier_name_gives_verifiable_tasks(tmp_path):
    tasks = load_task_file(write_jsonl(tmp_path / "quiz.jsonl", ROWS), verifier="general/exact")
    assert [t.id for t in tasks] == ["quiz-1", "capital", "quiz-3"]
    assert [t.effort for t in tasks] == ["high", "low", "high"]
    key = content_hash("Capital of France?", "Paris")
    assert tasks[1].meta == {"answer": "Paris", "source": "quiz", "verifier": "general/exact", "content_hash": key}
    assert tasks[2].meta["level"] == 2 and tasks[0].domain == "general"
    assert verify_task(tasks[0], "<think>6*7</think>42").reward == 1.0
    assert verify_task(tasks[2], "<think></think>1234").reward == 1.0
    assert verify_task(tasks[1], "<think></think> Paris.").reward == 1.0
    assert verify_task(tasks[1], "<think></think>Lyon").reward == 0.0
    assert verify_task(tasks[1], "Paris").reward == 0.0
    again = dataset_to_tasks(tasks_to_dataset(tasks))
    assert verify_task(again[0], "<think></think>42").reward == 1.0


def test_a_users_task_is_keyed_by_prompt_and_answer_like_a_generated_question(domain_tasks, tmp_path):
    """A generated train question pasted into a user's file (its answer written with a separator)
    gets the generated task's key, so a training record catches it; a given key is kept."""
    generated = domain_tasks["general"][0]
    answer = f"{int(generated.meta['answer']):,}"
    rows = [{"prompt": f"  {generated.prompt} ", "answer": answer},
            {"prompt": "Capital of France?", "answer": "Paris", "content_hash": generated.meta["content_hash"]}]
    tasks = load_task_file(write_jsonl(tmp_path / "copy.jsonl", rows), verifier="general/exact")
    assert [t.meta["content_hash"] for t in tasks] == [generated.meta["content_hash"]] * 2


def test_the_general_verifier_checks_plain_answers_too(tmp_path):
    tasks = load_task_file(write_jsonl(tmp_path / "plain.jsonl", ROWS[:1]), verifier="general")
    assert verify_task(tasks[0], "<think>6*7=42</think>42").reward == 1.0
    assert verify_task(tasks[0], "<think>6*7=42</think>43").reward == 0.0


def test_a_parquet_task_file_loads_like_jsonl(tmp_path):
    path = tmp_path / "quiz.parquet"
    datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]).to_parquet(
        path
    )
    tasks = load_task_file(path, verifier="general/exact", effort="max")
    assert [t.prompt for t in tasks] == [r["prompt"] for r in ROWS]
    assert {t.effort for t in tasks} == {"max"} and tasks[0].id == "quiz-0"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "answer": "1"}\n{"answer": "2"}\n', r"bad\.jsonl line 2: missing field 'prompt'"),
        ('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"\n', r"bad\.jsonl line 3: not valid JSON"),
        (
            '{"prompt": "a"}\n',
            r"bad\.jsonl line 1: missing field 'answer', required by verifier 'general/exact'",
        ),
        ('["a", "b"]\n', r"bad\.jsonl line 1: expected a JSON object, got list"),
        ('{"prompt": "a", "answer": "1", "effort": "medium"}\n', r"line 1: field 'effort' is 'medium'"),
        ('{"prompt": "a", "answer": "1", "meta": "{oops"}\n', r"line 1: field 'meta' is not valid JSON"),
        ('{"prompt": "a", "answer": "1", "content_hash": "abc"}\n', r"line 1: field 'content_hash' is 'abc', not 16"),
    ],
)
def test_bad_task_files_name_the_file_line_and_field(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TaskFileError, match=message):
        load_task_file(path, verifier="general/exact")


def test_bad_paths_and_verifier_names_are_named(tmp_path):
    with pytest.raises(TaskFileError, match=r"missing\.jsonl: no such task file"):
        load_task_file(tmp_path / "missing.jsonl", verifier="general")
    (tmp_path / "tasks.csv").write_text("prompt\n")
    with pytest.raises(TaskFileError, match=r"tasks\.csv: task files must end in \.jsonl or \.parquet"):
        load_task_file(tmp_path / "tasks.csv", verifier="general")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(TaskFileError, match=r"junk\.parquet: not a readable parquet file"):
        load_task_file(tmp_path / "junk.parquet", verifier="general")
    with pytest.raises(ValueError, match="unknown verifier 'general/fuzzy'"):
        load_task_file(write_jsonl(tmp_path / "ok.jsonl", ROWS), verifier="general/fuzzy")
    with pytest.raises(TaskFileError, match="required by verifier 'code'"):
        load_task_file(write_jsonl(tmp_path / "ok.jsonl", ROWS), verifier="code")


def test_verifiers_are_found_by_name_and_new_ones_can_be_registered(domain_tasks, tmp_path):
    for domain in DOMAINS:
        task = domain_tasks[domain][0]
        assert get_verifier(domain)(task, get_env(domain).solve(task)).reward == 1.0

    def length_at_most_five(task: Task, completion: str) -> Verdict:
        return Verdict(float(len(completion.split("</think>")[-1].strip()) <= 5))

    register_verifier("general/short", "general", length_at_most_five)
    tasks = load_task_file(
        write_jsonl(tmp_path / "short.jsonl", [{"prompt": "Say hi."}]), verifier="general/short"
    )
    assert verify_task(tasks[0], "<think></think>hi").reward == 1.0
    assert verify_task(tasks[0], "<think></think>hello there").reward == 0.0
    assert tasks[0].meta["content_hash"] == content_hash("Say hi.", "")  # no answer: the prompt alone decides
