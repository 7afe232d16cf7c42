"""K3 students made from a pretrained transformer, recovered by pair-mode MOPD from it (issue #43).

    python -m benchmarks.k3_conversion --teacher models/smollm2-135m --seeds 0,1,2 \
        --out runs/bench/k3_conversion.json

Per seed, four students of the same teacher (`mopd init-student`, the seed passed to it):

    converted           --arch k3 --init convert                      (measured, not trained)
    converted+transfer  --arch k3 --init convert --transfer-steps T   then MOPD
    random K3           --arch k3 --init random, the teacher's depth  then MOPD
    pruned              --arch same --layers L                        then MOPD

MOPD is `mopd distill`'s pair mode on one cell (its train split; the same seed, prompts, steps and
learning rate for every student), with a snapshot every `--curve-every` steps. Every snapshot is
measured as `benchmarks.mopd_vs_trl` measures a trained student, on `--eval-tasks` tasks of the
cell's test split drawn with the seed: the held-out reverse KL (token mean, on one completion per
task sampled by the student at temperature 1) and the greedy agreement (the share of the teacher's
greedy completion tokens where the student's argmax is the teacher's). The JSON is rewritten after
every measurement (a crash loses one run at most, and a rerun with the same --out skips what is
there); the PNG plots held-out KL against the tokens the student trained on, mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

from benchmarks.common import in_fresh_process
from benchmarks.mopd_vs_trl import SET_NUM_THREADS, affinity, held_out_kl, held_out_tasks
from mopd.machine import describe_machine

STUDENTS = {  # name → `init_student` options (the transfer's are filled in from the arguments)
    "converted": {"arch": "k3", "init": "convert"},
    "converted+transfer": {"arch": "k3", "init": "convert", "transfer": True},
    "random K3": {"arch": "k3", "init": "random", "preset": "small", "teacher_depth": True},
    "pruned": {"arch": "same", "halve_depth": True},
}
TRAINED = ("converted+transfer", "random K3", "pruned")


# ----------------------------------------------------------------------------- one seed's students
def make_student(name: str, teacher: Path, out: Path, seed: int, args) -> Path:
    """`mopd init-student` of one row, in this process."""
    from mopd.convert.student import init_student
    from mopd.model.config import read_model_config

    SET_NUM_THREADS(1)
    options = dict(STUDENTS[name])
    depth = read_model_config(teacher).num_hidden_layers
    if options.pop("transfer", False):
        options |= {"transfer_steps": args.transfer_steps, "transfer_prompts": args.transfer_prompts}
    if options.pop("teacher_depth", False):
        options["layers"] = depth
    if options.pop("halve_depth", False):
        options["layers"] = depth // 2
    return init_student(teacher, out, seed=seed, **options)


def train(student: Path, teacher: Path, out: Path, seed: int, args) -> Path:
    """Pair-mode MOPD (`mopd distill`) with snapshots every `curve_every` steps; the final student."""
    from mopd.distill.pair import distill_pair

    SET_NUM_THREADS(1)  # before the engine starts: vLLM's CPU worker makes the call a no-op afterwards
    domain, effort = args.cell.split("-")
    return distill_pair(
        teacher, student, out, domain=domain, effort=effort, seed=seed, progress=False, eval_tasks=0,
        steps=args.steps, prompts_per_step=args.prompts_per_step, learning_rate=args.lr,
        curve_every=args.curve_every, checkpoint_every=args.steps,
    )  # fmt: skip


def measure(student: Path, teacher: Path, cell: str, tasks: int, seed: int, reference: dict) -> dict:
    """Held-out reverse KL on the student's samples, and on the teacher's greedy completions the
    agreement and KL(teacher ‖ student) (which, unlike the first, a student collapsed onto a few
    tokens cannot lower)."""
    SET_NUM_THREADS(1)
    return {
        "held_out_kl": held_out_kl(student, teacher, held_out_tasks(tasks, seed, cell), seed=seed, cell=cell),
        **on_teacher_text(student, teacher, reference),
    }


def on_teacher_text(student_dir: Path, teacher_dir: Path, reference: dict) -> dict:
    """Greedy agreement and token-mean KL(teacher ‖ student) on the teacher's greedy completions."""
    from mopd.distill.loss import reverse_kl
    from mopd.distill.scorer import TeacherScorer

    prompts, completions = reference["prompts"], reference["completions"]
    student = TeacherScorer(student_dir).score(prompts, completions, full=True)
    teacher = TeacherScorer(teacher_dir).score(prompts, completions, full=True)
    tokens = sum(len(c) for c in completions)
    same = sum((s.full_logprobs.argmax(-1) == t.full_logprobs.argmax(-1)).sum().item() for s, t in zip(student, teacher, strict=True))
    kl = sum(reverse_kl(t.full_logprobs, s.full_logprobs).sum().item() for s, t in zip(student, teacher, strict=True))
    return {"greedy_agreement": same / tokens, "teacher_text_kl": kl / tokens}


def snapshots(run: Path) -> list[tuple[int, Path]]:
    """(step, checkpoint) of every learning-curve snapshot of a MOPD run and its final model, by step."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = max(r["step"] for r in records)
    found = [(int(p.name.split("-")[1]), p) for p in (run / "curve").glob("step-*")]
    return sorted([*found, (last, run / "model")])


def trained_tokens(run: Path) -> dict[int, int]:
    """Step → the student tokens trained on up to and including it."""
    total, out = 0, {0: 0}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            total += record["tokens_trained"]
            out[record["step"]] = total
    return out


# ----------------------------------------------------------------------------- the bench
def run_seed(seed: int, teacher: Path, work: Path, args, result: dict, save) -> None:
    rows = result["seeds"].setdefault(str(seed), {})
    if "reference" not in rows:
        started = time.time()
        reference = in_fresh_process(teacher_greedy_one_thread, teacher, args.cell, args.eval_tasks, seed)
        rows["reference"] = {"tokens": sum(len(c) for c in reference["completions"]), "seconds": round(time.time() - started, 1)}
        (work / f"reference-{seed}.json").write_text(json.dumps(reference))
    reference = json.loads((work / f"reference-{seed}.json").read_text())
    for name in STUDENTS:
        row = rows.setdefault(name, {})
        if row.get("done"):
            continue
        student = work / f"seed-{made_in(name, seed, args)}" / slug(name)
        if not (student / "init_student.json").exists():
            started = time.time()
            in_fresh_process(make_student, name, teacher, student, seed, args)
            row["init_seconds"] = round(time.time() - started, 1)
        row["parameters"] = parameters(student)
        row["curve"] = [{"step": 0, "tokens": 0, **in_fresh_process(measure, student, teacher, args.cell, args.eval_tasks, seed, reference)}]
        save()
        if name in TRAINED:
            run = work / f"seed-{seed}" / f"{slug(name)}-mopd"
            started = time.time()
            in_fresh_process(train, student, teacher, run, seed, args)
            row["train_seconds"] = round(time.time() - started, 1)
            tokens = trained_tokens(run)
            for step, snapshot in snapshots(run):
                point = in_fresh_process(measure, snapshot, teacher, args.cell, args.eval_tasks, seed, reference)
                row["curve"].append({"step": step, "tokens": tokens[step], **point})
                save()
        row["done"] = True
        save()
        print(f"seed {seed} {name}: " + ", ".join(
            f"step {p['step']} KL {p['held_out_kl']:.3f} text KL {p['teacher_text_kl']:.3f} agreement {p['greedy_agreement']:.3f}"
            for p in row["curve"]
        ), flush=True)  # fmt: skip


def made_in(name: str, seed: int, args) -> int:
    """The seed whose student a row starts from: its own, except the transferred student with
    `--transfer-once` (made once, with the first seed, and trained by MOPD from there in every seed)."""
    if name == "converted+transfer" and args.transfer_once:
        return int(args.seeds.split(",")[0])
    return seed


def teacher_greedy_one_thread(teacher: Path, cell: str, tasks: int, seed: int) -> dict:
    """The teacher's greedy completions of the seed's held-out tasks (the agreement's reference)."""
    from benchmarks.mopd_vs_trl import held_out_rollouts

    SET_NUM_THREADS(1)
    prompts, completions = held_out_rollouts(teacher, held_out_tasks(tasks, seed, cell), cell, temperature=0.0)
    return {"prompts": prompts, "completions": completions}


def parameters(student: Path) -> int:
    """Stored parameters of a checkpoint (a tied head counted once)."""
    from safetensors import safe_open

    total = 0
    for file in student.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return total


def slug(name: str) -> str:
    return name.replace(" ", "-").replace("+", "-").lower()


# ----------------------------------------------------------------------------- the claims
def summary(result: dict) -> dict:
    """Per row, the last snapshot's KL and agreement over seeds (mean, 95% t interval), and the
    per-seed ratios of the converted student's KL to the random K3's and to the pruned student's."""
    from mopd.stats import mean_interval

    seeds = [s for s in result["seeds"].values() if all(s.get(n, {}).get("done") for n in STUDENTS)]
    if not seeds:
        return {"seeds": 0}
    out = {"seeds": len(seeds)}
    for name in STUDENTS:
        for when, index in (("start", 0), ("end", -1)):
            for metric in ("held_out_kl", "teacher_text_kl", "greedy_agreement"):
                out[f"{name}/{when}/{metric}"] = mean_interval([s[name]["curve"][index][metric] for s in seeds])
    final = {name: [s[name]["curve"][-1]["held_out_kl"] for s in seeds] for name in TRAINED}
    out["kl_ratio/converted_vs_random"] = mean_interval([c / r for c, r in zip(final["converted+transfer"], final["random K3"], strict=True)])
    out["kl_ratio/converted_vs_pruned"] = mean_interval([c / p for c, p in zip(final["converted+transfer"], final["pruned"], strict=True)])
    text = {name: [s[name]["curve"][-1]["teacher_text_kl"] for s in seeds] for name in TRAINED}
    out["teacher_text_kl_ratio/converted_vs_random"] = mean_interval([c / r for c, r in zip(text["converted+transfer"], text["random K3"], strict=True)])
    out["teacher_text_kl_ratio/converted_vs_pruned"] = mean_interval([c / p for c, p in zip(text["converted+transfer"], text["pruned"], strict=True)])
    return out


def plot(result: dict, path: Path) -> None:
    """Both KLs vs trained tokens, one line per MOPD row: the mean over the seeds that have it, each seed faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("held_out_kl", "KL(student ‖ teacher) on the student's samples"),
              ("teacher_text_kl", "KL(teacher ‖ student) on the teacher's greedy text"))  # fmt: skip
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for color, name in zip(("tab:blue", "tab:red", "tab:green"), TRAINED, strict=True):
            curves = [s[name]["curve"] for s in result["seeds"].values() if s.get(name, {}).get("done")]
            if not curves:
                continue
            for curve in curves:
                ax.plot([p["tokens"] for p in curve], [p[metric] for p in curve], color=color, alpha=0.25, lw=1)
            points = min(len(c) for c in curves)
            tokens = [sum(c[i]["tokens"] for c in curves) / len(curves) for i in range(points)]
            mean = [sum(c[i][metric] for c in curves) / len(curves) for i in range(points)]
            ax.plot(tokens, mean, color=color, lw=2, marker="o", label=f"{name} + MOPD ({len(curves)} seeds)")
        ax.set_yscale("log")
        ax.set_xlabel("student tokens trained on")
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("nats/token")
        ax.legend(fontsize=8)
    fig.suptitle(f"K3 students from {result['teacher_name']}, held-out {result['cell']} tasks (test split)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, required=True, help="the pretrained HF checkpoint to convert and distil from")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write (a rerun resumes it)")
    parser.add_argument("--plot", type=Path, help="PNG of KL vs tokens (default: beside --out)")
    parser.add_argument("--work", type=Path, help="students and runs (default: beside --out)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--cell", default="general-low")
    parser.add_argument("--steps", type=int, default=8, help="MOPD steps of every trained row")
    parser.add_argument("--curve-every", type=int, default=4, help="steps between measured snapshots")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="MOPD learning rate (the recipe default; not tuned)")
    parser.add_argument("--eval-tasks", type=int, default=16, help="test-split tasks of the cell per seed")
    parser.add_argument("--transfer-steps", type=int, default=150)
    parser.add_argument("--transfer-prompts", type=int, default=200)
    parser.add_argument(
        "--transfer-once", action="store_true",
        help="make the transferred student once (first seed) and start every seed's MOPD from it: seeds then vary MOPD and the held-out tasks, not the transfer",
    )  # fmt: skip
    args = parser.parse_args(argv)
    work = args.work or args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    teacher = args.teacher.resolve()
    result = json.loads(args.out.read_text()) if args.out.exists() else {"seeds": {}}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "work", "teacher", "seeds")}
    result |= {
        "teacher": str(teacher), "teacher_name": args.teacher.name, "cell": args.cell, "settings": settings,
        "machine": describe_machine() | {"cpus": affinity(), "torch_threads_per_run": 1},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }  # fmt: skip

    def save():
        result["summary"] = summary(result)
        args.out.write_text(json.dumps(result, indent=1))

    for seed in [int(s) for s in args.seeds.split(",")]:
        run_seed(seed, teacher, work, args, result, save)
        plot(result, args.plot or args.out.with_suffix(".png"))
    save()
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
