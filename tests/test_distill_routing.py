"""Routing: each cell goes to exactly one teacher; bad mixes and teachers fail before any work."""

import random
import shutil
from collections import Counter

import pytest
import torch

from mopd.distill import routing
from mopd.distill.routing import RoutingError, Vocabulary, build_route_table, check_teachers, read_checkpoint
from mopd.envs.tokenizer import build_tokenizer
from mopd.model import K3HybridForCausalLM, preset_config


def save_checkpoint(path, tokenizer, seed=0, **overrides):
    torch.manual_seed(seed)
    config = preset_config("tiny", num_hidden_layers=2, vocab_size=overrides.pop("vocab_size", len(tokenizer)))
    K3HybridForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "student": save_checkpoint(root / "student", tokenizer),
        "teacher": save_checkpoint(root / "teacher", tokenizer, seed=1),
        "root": root,
    }


def test_every_mixed_cell_routes_to_its_teacher_and_aliases_share_one(checkpoints):
    teacher, other = checkpoints["teacher"], checkpoints["student"]
    table = build_route_table(
        {"general-low": 1.0, "general-high": 2.0, "code-max": 0.0},
        {"general-low": teacher, "general-high": teacher, "agent-low": other},
    )
    assert table.teacher_for("general-low") == table.teacher_for("general-high") == teacher.resolve()
    assert set(table.routes) == {"general-low", "general-high"}  # zero weight: not sampled, not routed
    assert table.teachers == {teacher.resolve(): ["general-low", "general-high"]}
    with pytest.raises(RoutingError, match="agent-low"):
        table.teacher_for("agent-low")


def test_a_mixed_cell_without_a_teacher_is_an_error():
    with pytest.raises(RoutingError, match=r"\['agent-max'\].*no teacher"):
        build_route_table({"general-low": 1.0, "agent-max": 1.0}, {"general-low": "/x"})


def test_cells_are_drawn_in_proportion_to_the_weights():
    table = build_route_table({"general-low": 1.0, "agent-high": 2.0, "code-max": 1.0}, dict.fromkeys(["general-low", "agent-high", "code-max"], "/x"))
    counts = Counter(table.sample_cells(8, random.Random(0)))
    assert counts == {"general-low": 2, "agent-high": 4, "code-max": 2}
    draws = Counter(c for seed in range(200) for c in table.sample_cells(3, random.Random(seed)))
    assert draws["agent-high"] == pytest.approx(300, abs=30)  # remainders go by weight, fairly
    assert sum(draws.values()) == 600


def test_matching_teachers_pass_the_start_checks(checkpoints, tokenizer, monkeypatch):
    """Teachers with the student's tokenizer and vocabulary size (other weights) raise nothing, and each
    distinct teacher is checked once, aliases together."""
    student, teacher = checkpoints["student"], checkpoints["teacher"]
    copy = shutil.copytree(teacher, checkpoints["root"] / "teacher-copy")
    table = build_route_table(
        {"general-low": 1.0, "general-high": 1.0, "code-max": 1.0},
        {"general-low": teacher, "general-high": teacher, "code-max": copy},
    )
    read = []
    monkeypatch.setattr(routing, "read_checkpoint", lambda path, role: read.append((path, role)) or read_checkpoint(path, role))
    assert check_teachers(table, student) is None
    assert read == [(student, "student"), (teacher.resolve(), "teacher of general-low, general-high"), (copy.resolve(), "teacher of code-max")]
    vocabularies = [read_checkpoint(path, role) for path, role in read]
    assert all(v == Vocabulary(len(tokenizer), tokenizer.get_vocab()) for v in vocabularies)
    assert (teacher / "model.safetensors").read_bytes() != (student / "model.safetensors").read_bytes()


def test_a_teacher_with_another_tokenizer_is_named_with_the_student(checkpoints, tokenizer):
    other = build_tokenizer(["completely different corpus text 123 " * 50], vocab_size=len(tokenizer))
    teacher = save_checkpoint(checkpoints["root"] / "other-tok", other, vocab_size=len(tokenizer))
    table = build_route_table({"general-low": 1.0}, {"general-low": teacher})
    with pytest.raises(RoutingError, match="different tokenizers") as err:
        check_teachers(table, checkpoints["student"])
    assert str(teacher.resolve()) in str(err.value) and str(checkpoints["student"]) in str(err.value)


def test_a_teacher_with_another_vocab_size_is_an_error(checkpoints, tokenizer):
    teacher = save_checkpoint(checkpoints["root"] / "big-vocab", tokenizer, vocab_size=len(tokenizer) + 64)
    table = build_route_table({"agent-low": 1.0}, {"agent-low": teacher})
    with pytest.raises(RoutingError, match=f"vocab_size {len(tokenizer) + 64}.*student .* has {len(tokenizer)}"):
        check_teachers(table, checkpoints["student"])


def test_missing_and_unreadable_teacher_checkpoints_are_clear_errors(checkpoints):
    missing = checkpoints["root"] / "nowhere"
    table = build_route_table({"code-high": 1.0}, {"code-high": missing})
    with pytest.raises(RoutingError, match=r"teacher of code-high checkpoint .*nowhere does not exist"):
        check_teachers(table, checkpoints["student"])

    torn = shutil.copytree(checkpoints["teacher"], checkpoints["root"] / "torn")
    (torn / "model.safetensors").write_bytes(b"\x00" * 16)
    table = build_route_table({"code-high": 1.0}, {"code-high": torn})
    with pytest.raises(RoutingError, match=r"unreadable weights model\.safetensors"):
        check_teachers(table, checkpoints["student"])

    shutil.copy(checkpoints["teacher"] / "model.safetensors", torn)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (torn / name).unlink()
    with pytest.raises(RoutingError, match=r"torn has no tokenizer \(tokenizer\.json\)"):
        check_teachers(table, checkpoints["student"])

    (torn / "config.json").write_text("{not json")
    with pytest.raises(RoutingError, match=r"unreadable config\.json"):
        check_teachers(table, checkpoints["student"])
