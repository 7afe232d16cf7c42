"""The ours-vs-TRL benchmark's measures: the held-out KL, the step speed and the seed intervals."""

import math

import pytest
import torch

from mopd.distill.bench_trl import main, mean_interval, reverse_kl, speed


def test_reverse_kl_is_the_hand_computed_divergence_on_two_tokens():
    student = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    teacher = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    by_hand = [
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
        0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5),
    ]
    torch.testing.assert_close(reverse_kl(student.log(), teacher.log()), torch.tensor(by_hand))
    assert reverse_kl(teacher.log(), teacher.log()).abs().max() < 1e-7


def test_speed_leaves_out_the_warm_up_step_and_weights_steps_by_tokens():
    run = {"step_seconds": [9.0, 1.0, 3.0, 2.0], "tokens": [100, 300, 300, 600]}
    assert speed(run) == {"step_seconds_median": 2.0, "completion_tokens_per_s": 1200 / 6.0}
    assert speed({"step_seconds": [4.0], "tokens": [100]}) == {
        "step_seconds_median": 4.0,
        "completion_tokens_per_s": 25.0,
    }


def test_mean_interval_over_seeds():
    interval = mean_interval([1.0, 2.0, 3.0])
    half = 1.959964 * 1.0 / math.sqrt(3)
    assert interval == pytest.approx({"mean": 2.0, "low": 2.0 - half, "high": 2.0 + half})
    assert mean_interval([0.5]) == {"mean": 0.5, "low": None, "high": None}


def test_bad_arguments_are_refused_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    for argv, message in [
        (["--preset-small", "--teacher", str(tmp_path)], "give --teacher, or --preset-small"),
        (["--teacher", str(tmp_path / "nowhere")], "nowhere: no config.json"),
        (["--teacher", str(tmp_path), "--seeds", "0,x"], "--seeds '0,x'"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["--student", str(tmp_path), "--out", str(tmp_path / "out.json"), *argv])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err
