"""The ours-vs-TRL benchmark: the held-out KL, the t intervals, the timed window, the shared-input checks,
the best-TRL-row ratios, failed rows, and (slow) one TRL row and ours end to end on a tiny pair."""

import contextlib
import functools
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks import mopd_vs_trl
from benchmarks.mopd_vs_trl import (
    best_row,
    check_run,
    comparisons,
    main,
    mean_interval,
    prompts_digest,
    ratios,
    reverse_kl,
    summarise,
    thread_budget,
    timed_window,
)
from mopd import stats
from mopd.precision import bf16_supported


def test_reverse_kl_is_the_hand_computed_divergence_on_two_tokens():
    student = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    teacher = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    by_hand = [
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
        0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5),
    ]
    torch.testing.assert_close(reverse_kl(student.log(), teacher.log()), torch.tensor(by_hand))
    assert reverse_kl(teacher.log(), teacher.log()).abs().max() < 1e-7


# ----------------------------------------------------------------------------- Student t
@pytest.mark.parametrize(
    ("p", "df", "table"),
    [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 30, 2.042),
        (0.975, 10, 2.228),
        (0.995, 4, 4.604),
        (0.95, 5, 2.015),
    ],
)
def test_t_quantile_matches_the_printed_table(p, df, table):
    assert stats.t_quantile(p, df) == pytest.approx(table, abs=5e-4)
    assert stats.t_quantile(1 - p, df) == pytest.approx(-stats.t_quantile(p, df), rel=1e-9)


def test_t_distribution_against_closed_forms_and_the_normal_limit():
    for t in (-3.0, -0.4, 0.0, 0.7, 5.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert stats.t_quantile(0.9999999, 1) == pytest.approx(math.tan(math.pi * (0.9999999 - 0.5)), rel=1e-6)
    assert stats.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert stats.t_quantile(0.5, 3) == 0.0
    for bad in [(0.0, 3), (1.0, 3), (0.9, 0)]:
        with pytest.raises(ValueError):
            stats.t_quantile(*bad)


def test_mean_interval_over_seeds_uses_the_t_quantile():
    assert mopd_vs_trl.mean_interval is stats.mean_interval
    interval = mean_interval([1.0, 2.0, 3.0])
    half = 4.302653 * 1.0 / math.sqrt(3)  # t_{0.975, 2}, not the normal 1.96
    assert interval == pytest.approx({"mean": 2.0, "low": 2.0 - half, "high": 2.0 + half})
    assert mean_interval([0.5]) == {"mean": 0.5, "low": None, "high": None}
    wide = mean_interval([1.0, 2.0, 3.0], level=0.99)
    assert wide["high"] - wide["mean"] == pytest.approx(9.924843 / math.sqrt(3), rel=1e-5)


# ----------------------------------------------------------------------------- the timed window
def test_window_of_a_synchronous_run_counts_each_timed_steps_own_batch():
    steps = [(0.0, 9.0), (9.5, 10.5), (11.0, 14.0), (14.0, 16.0)]  # 0.5 s of logging between some steps
    batches = [
        {"start": s + 0.1, "end": s + 0.5, "tokens": n} for (s, _), n in zip(steps, [100, 300, 300, 600], strict=True)
    ]
    speed = timed_window(steps, batches)
    assert speed["step_seconds_median"] == 2.0  # of 1, 3, 2: the warm-up step is left out
    assert speed["window_seconds"] == 16.0 - 9.5  # wall time, the gaps included
    assert speed["window_tokens"] == 1200 and speed["window_batches"] == 3
    assert speed["completion_tokens_per_s"] == 1200 / 6.5
    one = timed_window([(0.0, 4.0)], [{"start": 1.0, "end": 3.0, "tokens": 100}])
    assert one["completion_tokens_per_s"] == 25.0 and one["step_seconds_median"] == 4.0


def test_window_one_step_off_counts_only_batches_sampled_inside_it():
    """Step n trains on batch n and samples batch n+1 meanwhile: the warm-up step samples batches 1 and 2,
    the timed steps 2..4 sample 3 and 4, the last step samples none. Batch 2 is trained in the window but
    was sampled before it, so it is not counted (the off-by-one-batch the old count made)."""
    steps = [(0.0, 10.0), (10.0, 12.0), (12.0, 14.0), (14.0, 15.0)]
    batches = [
        {"start": 0.0, "end": 4.0, "tokens": 50},  # batch 1, sampled synchronously in step 1
        {"start": 4.1, "end": 9.0, "tokens": 60},  # batch 2, prefetched during step 1
        {"start": 10.1, "end": 11.9, "tokens": 70},  # batch 3, during step 2
        {"start": 12.1, "end": 13.5, "tokens": 80},  # batch 4, during step 3
    ]
    speed = timed_window(steps, batches)
    assert speed["window_tokens"] == 70 + 80 and speed["window_batches"] == 2
    assert speed["completion_tokens_per_s"] == 150 / 5.0
    straddling = {"start": 9.0, "end": 10.5, "tokens": 999}  # began before the window: not counted
    assert timed_window(steps, [*batches, straddling])["window_tokens"] == 150


# ----------------------------------------------------------------------------- shared inputs
def a_run(**changes) -> dict:
    run = {
        "steps": [(0.0, 1.0), (1.0, 2.0)],
        "prompts_sha256": prompts_digest([[1, 2], [3]]),
        "sampling": {"temperature": 1, "top_p": 1.0, "top_k": None},
        "dtypes": {"trained": "torch.float32", "vllm": "torch.float32"},
        "autocast": {"student": ["off"], "teacher": ["off"]},
        "cpus": [0],
        "torch_threads": {"MainThread": 1},
    }
    return run | changes


def test_check_run_refuses_a_run_that_did_not_share_the_inputs():
    budget = thread_budget("trl_hf", 1, [0, 1])
    digest = prompts_digest([[1, 2], [3]])
    assert check_run(a_run(), 2, digest, budget) is None
    broken = {
        "timed 1 steps": a_run(steps=[(0.0, 1.0)]),
        "other prompt token ids": a_run(
            prompts_sha256=prompts_digest([[3], [1, 2]])
        ),  # the same prompts reordered
        "sampled with": a_run(sampling={"temperature": 1.0, "top_p": 0.95, "top_k": 0}),
        "dtypes": a_run(dtypes={"trained": "torch.float32", "vllm": "torch.bfloat16"}),
        "forwards under autocast": a_run(autocast={"student": ["off"], "teacher": ["off", "bfloat16"]}),
        "ran on CPUs": a_run(cpus=[0, 1]),
        "per computing thread": a_run(torch_threads={"MainThread": 1, "mopd-rollouts_0": 2}),
    }
    for reason, run in broken.items():
        assert reason in check_run(run, 2, digest, budget)


def test_check_run_holds_a_bf16_run_to_fp32_weights_bf16_engines_and_autocast_in_every_forward():
    budget = thread_budget("ours", 1, [0, 1])
    digest = prompts_digest([[1, 2], [3]])
    bf16 = {"dtypes": {"trained": "torch.float32", "vllm": "torch.bfloat16", "teacher vllm": "torch.bfloat16"},
            "autocast": {"student": ["bfloat16"], "teacher": ["bfloat16"]}}  # fmt: skip
    assert check_run(a_run(**bf16), 2, digest, budget, precision="bf16") is None
    broken = {
        "fp32 run": a_run(),
        "bf16 weights (not mixed precision)": a_run(**bf16 | {"dtypes": {"trained": "torch.bfloat16", "vllm": "torch.bfloat16"}}),
        "an fp32 engine": a_run(**bf16 | {"dtypes": {"trained": "torch.float32", "vllm": "torch.float32"}}),
        "a teacher forward outside autocast": a_run(**bf16 | {"autocast": {"student": ["bfloat16"], "teacher": ["off", "bfloat16"]}}),
        "no forward watched": a_run(**bf16 | {"autocast": {}}),
    }
    for what, run in broken.items():
        assert check_run(run, 2, digest, budget, precision="bf16") is not None, what


def test_thread_budget_gives_every_row_the_same_cpus_and_splits_them_one_step_off():
    assert thread_budget("trl_vllm", 2, [3, 1, 5]) == {
        "cpus": [1, 3],
        "torch_threads": 2,
        "computing_threads": 1,
    }
    for one_step_off in ("ours_async", "ours_actor"):  # the trainer and the sampler (a thread or an actor)
        assert thread_budget(one_step_off, 2, [3, 1, 5]) == {
            "cpus": [1, 3],
            "torch_threads": 1,
            "computing_threads": 2,
        }
    assert thread_budget("ours_async", 1, [0, 1])["cpus"] == thread_budget("ours", 1, [0, 1])["cpus"] == [0]
    with pytest.raises(ValueError, match="only 2 CPUs"):
        thread_budget("ours", 3, [0, 1])


# ----------------------------------------------------------------------------- rows and ratios
def row(tokens_per_s: list[float], step_seconds: list[float], kl: list[float] | None = None) -> dict:
    runs = [
        {"seed": seed, "speed": {"completion_tokens_per_s": t, "step_seconds_median": s}}
        | ({"held_out_kl": kl[seed]} if kl else {})
        for seed, (t, s) in enumerate(zip(tokens_per_s, step_seconds, strict=True))
    ]
    return summarise(runs)


def test_best_trl_row_is_the_fastest_that_ran_and_ratios_pair_seeds():
    rows = {
        "ours": row([200.0, 300.0, 260.0], [1.0, 0.8, 0.9], kl=[0.1, 0.2, 0.3]),
        "ours_async": row([400.0, 420.0, 390.0], [0.5, 0.5, 0.6]),
        "trl_hf": row([100.0, 150.0, 130.0], [2.0, 1.6, 1.8], kl=[0.2, 0.2, 0.3]),
        "trl_vllm": row([50.0, 60.0, 55.0], [4.0, 3.5, 3.8]),
        "gkd": row([90.0, 140.0, 120.0], [2.2, 1.7, 1.9]),
        "trl_async": summarise([{"seed": 0, "error": "ImportError: no kernels"}, {"seed": 1, "speed": {}}]),
    }
    rows["trl_async"]["completion_tokens_per_s"] = {
        "mean": 1e9
    }  # a failed row is never the best, however fast
    assert best_row(rows, mopd_vs_trl.SYNC_TRL) == "trl_hf"
    assert best_row(rows, mopd_vs_trl.TRL) == "trl_hf"
    assert best_row(rows, ["trl_async"]) is None

    out = comparisons(rows)
    sync = out["ours / best synchronous TRL row"]
    assert sync["trl"] == "trl_hf"
    per_seed = [2.0, 2.0, 2.0]  # 200/100, 300/150, 260/130
    assert (
        sync["completion_tokens_per_s"] == {"mean": 2.0, "low": 2.0, "high": 2.0} == mean_interval(per_seed)
    )
    steps = [0.5, 0.5, 0.5]
    assert sync["step_seconds"] == pytest.approx(mean_interval(steps))
    kl = [0.5, 1.0, 1.0]
    assert sync["held_out_kl"] == pytest.approx(mean_interval(kl))
    assert out["ours_async / AsyncDistillationTrainer"] == {
        "trl": "trl_async",
        "error": "trl_async did not run: seed 0: ImportError: no kernels",
    }
    against_best = out["ours_async / best TRL row"]
    expected = mean_interval([400 / 100, 420 / 150, 390 / 130])
    assert against_best["trl"] == "trl_hf" and against_best["completion_tokens_per_s"] == pytest.approx(
        expected
    )
    assert "held_out_kl" not in against_best  # ours_async has none
    half = expected["high"] - expected["mean"]
    assert half == pytest.approx(4.302653 * statistics.stdev([4.0, 2.8, 3.0]) / math.sqrt(3), rel=1e-6)


def test_ratios_are_means_of_per_seed_ratios_not_ratios_of_means():
    ours, trl = row([100.0, 400.0], [1.0, 1.0]), row([50.0, 400.0], [1.0, 1.0])
    assert ratios(ours, trl)["completion_tokens_per_s"]["mean"] == pytest.approx((2.0 + 1.0) / 2)


def test_a_trl_agreement_of_zero_gives_no_ratio_but_the_paired_difference():
    ours, trl = row([1.0, 1.0], [1.0, 1.0]), row([1.0, 1.0], [1.0, 1.0])
    for r, agreement in zip([*ours["runs"], *trl["runs"]], [0.04, 0.02, 0.0, 0.01], strict=True):
        r["greedy_agreement"] = agreement
    out = ratios(summarise(ours["runs"]), summarise(trl["runs"]))
    assert out["greedy_agreement"]["mean"] is None and "is 0" in out["greedy_agreement"]["undefined"]
    assert out["greedy_agreement_difference"]["mean"] == pytest.approx((0.04 + 0.01) / 2)


def test_every_finished_run_is_kept_as_it_ends_and_resume_reuses_only_those(tmp_path, monkeypatch):
    calls = []

    def fake(student, teacher, out, seed, *args):
        calls.append(seed)
        if seed == 1 and len(calls) == 2:
            raise RuntimeError("killed")
        return {"seed": seed}

    monkeypatch.setattr(mopd_vs_trl, "one_run", lambda config, s, t, w, seed, *args: fake(s, t, w, seed))
    monkeypatch.setattr(mopd_vs_trl, "step_prompts", lambda *args: [[{"text": "x", "ids": [1]}]])
    out = tmp_path / "b.json"
    args = mopd_vs_trl.argparse.Namespace(configs=["ours"], seeds=[0, 1, 2], steps=1, prompts_per_step=1, threads=1,
                                          cpus=[0], eval_tasks=0, out=out)  # fmt: skip
    with pytest.raises(RuntimeError, match="killed"):
        mopd_vs_trl.bench(tmp_path, tmp_path, tmp_path, args)
    assert mopd_vs_trl.finished_runs(out) == {("ours", 0): {"seed": 0}}  # seed 0 was kept before the crash
    args.done = mopd_vs_trl.finished_runs(out)
    with contextlib.suppress(Exception):  # fake records have no speed to summarise
        mopd_vs_trl.bench(tmp_path, tmp_path, tmp_path, args)
    assert calls == [0, 1, 1, 2]  # the resumed benchmark ran seeds 1 and 2 only
    assert set(mopd_vs_trl.finished_runs(out)) == {("ours", 0), ("ours", 1), ("ours", 2)}


def test_comparisons_say_why_when_the_trl_row_is_missing():
    rows = {"ours": row([1.0], [1.0]), "trl_async": row([1.0], [1.0])}
    out = comparisons(rows)
    assert out == {"ours / best synchronous TRL row": {"error": "no best synchronous TRL row ran"}}


def test_a_failing_config_is_recorded_and_the_benchmark_goes_on(tmp_path, monkeypatch):
    def raising(*args):
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(mopd_vs_trl, "in_fresh_process", lambda fn, *args: fn(*args))
    monkeypatch.setattr(mopd_vs_trl, "RUNNERS", mopd_vs_trl.RUNNERS | {"trl_async": (raising, {}, "TRL async")})
    monkeypatch.setattr(mopd_vs_trl, "step_prompts", lambda *args: [[{"text": "x", "ids": [1]}]])
    args = mopd_vs_trl.argparse.Namespace(
        configs=["trl_async"],
        seeds=[0, 1],
        steps=1,
        prompts_per_step=1,
        threads=1,
        cpus=[0],
        eval_tasks=0,
        trl_async_servers=["a", "b"],
    )
    rows, _ = mopd_vs_trl.bench(tmp_path, tmp_path, tmp_path, args)
    assert rows["trl_async"]["error"] == "seed 0: RuntimeError: no NCCL here"
    assert [r["error"] for r in rows["trl_async"]["runs"]] == ["RuntimeError: no NCCL here"] * 2
    assert "completion_tokens_per_s" not in rows["trl_async"]


# ----------------------------------------------------------------------------- the command line
def test_bad_arguments_are_refused_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    for argv, message in [
        (["--preset-small", "--teacher", str(tmp_path)], "give --teacher, or --preset-small"),
        (["--teacher", str(tmp_path / "nowhere")], "nowhere: no config.json"),
        (["--teacher", str(tmp_path), "--seeds", "0,x"], "--seeds '0,x'"),
        (["--teacher", str(tmp_path), "--configs", "ours,trl_fast"], "--configs ours,trl_fast: rows are"),
        (["--teacher", str(tmp_path), "--trl-async-servers", "http://a"], "STUDENT_URL,TEACHER_URL"),
        (["--teacher", str(tmp_path), "--threads", "999"], "--threads 999: only"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["--student", str(tmp_path), "--out", str(tmp_path / "out.json"), *argv])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err


def a_tiny_pair(tmp_path: Path, tokenizer) -> tuple[Path, Path]:
    from mopd.model import K3HybridForCausalLM, preset_config
    from tests.fakes import seeded_copy

    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tokenizer))).save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    return tmp_path / "student", seeded_copy(tmp_path / "student", tmp_path / "teacher", seed=1)


def bench_tiny_pair(tmp_path: Path, tokenizer, *options: str) -> dict:
    """One seed, two steps of two prompts, no held-out KL, trl_hf and ours: each row in its own process."""
    student, teacher = a_tiny_pair(tmp_path, tokenizer)
    out = tmp_path / "trl.json"
    main(["--student", str(student), "--teacher", str(teacher), "--out", str(out), "--configs", "trl_hf,ours",
          "--seeds", "0", "--steps", "2", "--prompts-per-step", "2", "--eval-tasks", "0", *options])  # fmt: skip
    result = json.loads(out.read_text())
    assert not [n for n, r in result["rows"].items() if "error" in r], result["rows"]
    return result


@pytest.mark.slow
def test_trl_distillation_trainer_and_ours_end_to_end_on_a_tiny_pair(tmp_path, tiny_tokenizer):
    """~35 s on 2 cores."""
    result = bench_tiny_pair(tmp_path, tiny_tokenizer)
    rows = result["rows"]
    assert set(rows) == {"trl_hf", "ours"}
    runs = [rows[name]["runs"][0] for name in ("trl_hf", "ours")]
    digest = result["setup"]["prompts_sha256"]["0"]
    for run in runs:
        assert run["prompts_sha256"] == digest and run["cpus"] == result["machine"]["cpus"]
        assert run["speed"]["window_batches"] == 1 and run["speed"]["window_tokens"] > 0
        assert run["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        assert run["autocast"] == {"student": ["off"], "teacher": ["off"]}  # read on entering each model's body
    trl, ours = runs
    for step in range(2):  # TRL's step splits into its generation, its teacher's forwards and the rest
        phases = [trl["phase_seconds"][p][step] for p in ("sample", "score", "train")]
        assert min(phases) > 0 and sum(phases) == pytest.approx(trl["steps"][step][1] - trl["steps"][step][0])
    assert set(mopd_vs_trl.PHASES) <= set(ours["phase_seconds"])
    assert result["best_trl"] == {"synchronous": "trl_hf", "any": "trl_hf"}
    ratio = result["ours_over_trl"]["ours / best synchronous TRL row"]
    tokens = [r["speed"]["completion_tokens_per_s"] for r in runs]
    assert ratio["trl"] == "trl_hf" and ratio["completion_tokens_per_s"]["mean"] == pytest.approx(
        tokens[1] / tokens[0]
    )
    assert ratio["completion_tokens_per_s"]["low"] is None  # one seed: no interval
    assert "machine" in result and result["machine"]["cpu_count"] >= 1


@pytest.mark.slow
@pytest.mark.skipif(not bf16_supported("cpu"), reason="bf16 rows need a CPU with AVX-512 BF16 or AMX (--precision refuses them elsewhere)")
def test_both_trainers_run_bf16_autocast_over_fp32_weights_with_a_bf16_sampler(tmp_path, tiny_tokenizer):
    result = bench_tiny_pair(tmp_path, tiny_tokenizer, "--precision", "bf16")
    assert result["setup"]["precision"] == "bf16"
    trl, ours = (result["rows"][name]["runs"][0] for name in ("trl_hf", "ours"))
    for run in (trl, ours):  # check_run enforced it; read back here as well
        assert run["autocast"] == {"student": ["bfloat16"], "teacher": ["bfloat16"]}
        assert run["dtypes"]["trained"] == "torch.float32"
    assert ours["dtypes"]["vllm"] == "torch.bfloat16"


def test_bf16_is_refused_by_name_where_the_cpu_lacks_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mopd_vs_trl, "check_precision", functools.partial(mopd_vs_trl.check_precision, supported=False))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--student", str(tmp_path), "--teacher", str(tmp_path), "--out", str(tmp_path / "o.json"), "--precision", "bf16"])
    assert "--precision: bf16 needs a CPU with AVX-512 BF16 or AMX" in capsys.readouterr().err


def test_the_markdown_summary_holds_each_row_its_ratios_and_both_trainers_phases(tmp_path):
    rows = {"ours": row([200.0, 300.0], [1.0, 0.8]), "trl_hf": row([100.0, 150.0], [2.0, 1.6])}
    rows["ours"]["runs"][0]["phase_seconds"] = {key: [9.0, 1.0, 3.0] for key in mopd_vs_trl.PHASES}  # the warm-up left out
    rows["ours"]["runs"][1]["phase_seconds"] = {key: [9.0, 2.0] for key in mopd_vs_trl.PHASES}
    for run in rows["trl_hf"]["runs"]:
        run["phase_seconds"] = {"sample": [9.0, 4.0], "score": [9.0, 1.0], "train": [9.0, 5.0]}
    setup = {"student": "S", "teacher": "T", "cell": "general-high", "configs": ["ours", "trl_hf"], "seeds": [0, 1],
             "steps": 3, "prompts_per_step": 4, "eval_tasks": 0, "max_new_tokens": 162, "precision": "bf16",
             "interval": "95%, Student t, df = seeds - 1"}  # fmt: skip
    result = {"benchmark": "pair mode", "setup": setup, "machine": {"cpus_per_run": 2}, "rows": rows,
              "ours_over_trl": comparisons(rows)}  # fmt: skip
    mopd_vs_trl.write_markdown(tmp_path / "b.json", result)
    text = (tmp_path / "b.md").read_text()
    assert "--student S --teacher T --cell general-high --configs ours,trl_hf --threads 2 --seeds 0,1 --steps 3" in text
    assert "| ours | " in text and "| 250.000 [" in text  # the mean of 200 and 300
    assert "| ours / best synchronous TRL row (trl_hf) | 2.000 [2.000, 2.000] |" in text
    assert "| ours | 2.000 | 2.000 | 2.000 | 2.000 | 2.000 |" in text  # median of 1, 3 and 2 after each warm-up
    assert "| trl_hf | 4.000 | 1.000 | 5.000 | — | — |" in text  # TRL times no rollout wait or weight sync
    assert "--precision bf16 --out" in text and "new tokens, bf16," in text
