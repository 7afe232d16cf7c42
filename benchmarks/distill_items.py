"""Issue #58's items, each alone: teacher scoring in vLLM, and packed (unpadded) rows, against today's path;
the student's head over completion positions only against the head over every position (as before 89abd11);
the fused exact KL over the trained positions against the whole-tensor one (as before ce4f722).

    python -m benchmarks.distill_items --student models/smol-15 --teacher models/smollm2-135m \
        --cells general-low,general-high --prompts 8 --repeats 3 [--precision bf16] [--items scoring,packing,head,fused] \
        --out runs/bench/distill_items_smollm2.json

One batch of rollouts is sampled once from the student (vLLM, the cells' train prompts, as many from each,
temperature 1; cells of different efforts give a mix of lengths, as MOPD's mix of cells does), then
timed on the same token ids, side by side in this process, the two sides alternating, every side at
`--precision` (fp32, or bf16 autocast: `distill.precision`):
  scoring   the teacher's sampled-token scores: HF `TeacherScorer` (padded batches, the default) against
            `VllmTeacherScorer` (a vLLM prefill, `distill.scoring: vllm`), the largest gap recorded
  packing   the student's `train_step` (sampled-token loss) padded against packed (`distill.packing`), on two
            students loaded alike, and the HF teacher's scoring padded against packed; a model that cannot
            pack (the K3 hybrid) is recorded with the reason
  head      the student's `train_step` (the default loss, the exact full-vocabulary KL) with the head over the
            completion columns only (`Student.trained_logits`) against the head over every position, prompts too
  fused     the same step with the KL fused over the trained positions (`vocab_reverse_kl`) against the
            whole-tensor KL over every completion position (`whole_tensor_full_vocab_loss`)
Each side is warmed up once; the medians of `--repeats` timings and their ratio (today's ÷ the item's) are
written with the machine's description. Every thread of the process is confined to `--threads` CPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mopd.artifacts import write_json_atomic
from mopd.distill.loss import extrapolated_teacher, full_vocab_reverse_kl, mopd_loss
from mopd.distill.packing import PackingError
from mopd.distill.routing import cell_of
from mopd.distill.scorer import TeacherScorer, VllmTeacherScorer
from mopd.distill.student import Student, pad_stack
from mopd.envs import get_env
from mopd.envs.effort import default_effort_specs
from mopd.machine import describe_machine, keep_freed_memory
from mopd.precision import PrecisionError, autocast, check_precision
from mopd.recipe import DistillSpec
from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import Rollout, run_rollouts

SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op when its engine starts


def pin(cpus: list[int], threads: int) -> None:
    """Every thread of this process (and those it starts later) on `cpus`; `threads` torch threads; freed memory
    kept for reuse (`keep_freed_memory`, as `mopd distill` does)."""
    keep_freed_memory()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
    SET_NUM_THREADS(threads)


def sample_rollouts(student: Path, cells: list[str], prompts: int, seed: int, max_model_len: int) -> list[Rollout]:
    from transformers import AutoTokenizer

    envs = {domain: get_env(domain) for domain in {cell.split("-")[0] for cell in cells}}
    tasks = []
    for cell in cells:
        domain, effort = cell.split("-")
        tasks += envs[domain].sample(prompts // len(cells), seed, "train", effort)
    engine = create_engine(student, backend="vllm", max_model_len=max_model_len)
    try:
        groups = run_rollouts(engine, AutoTokenizer.from_pretrained(student), envs, tasks, default_effort_specs(), n=1, seed=seed)
    finally:
        engine.close()
    return [r for group in groups for r in group]


def alternate(sides: dict[str, callable], repeats: int) -> dict[str, list[float]]:
    """Seconds of each side's call, warmed up once, then `repeats` rounds of every side in turn."""
    for call in sides.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, call in sides.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def summary(seconds: dict[str, list[float]], before: str, after: str, tokens: int) -> dict:
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    return {
        "seconds": seconds,
        "median_seconds": medians,
        "tokens_per_s": {name: tokens / median for name, median in medians.items()},
        "ratio": medians[before] / medians[after],
    }


def bench_scoring(teacher: Path, rollouts: list[Rollout], repeats: int, max_model_len: int, precision: str) -> dict:
    prompts, completions = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
    hf = TeacherScorer(teacher, precision=precision)
    vllm = VllmTeacherScorer(teacher, max_model_len=max_model_len, precision=precision)
    try:
        gap = max(
            (a.logprobs - b.logprobs).abs().max().item()
            for a, b in zip(hf.score(prompts, completions), vllm.score(prompts, completions), strict=True)
        )
        seconds = alternate({"hf": lambda: hf.score(prompts, completions), "vllm": lambda: vllm.score(prompts, completions)}, repeats)
    finally:
        vllm.offload()
    return {**summary(seconds, "hf", "vllm", sum(map(len, completions))), "max_abs_logprob_gap": gap}


def bench_packing(student: Path, teacher: Path, rollouts: list[Rollout], repeats: int, precision: str) -> dict:
    prompts, completions = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    out = {"tokens": tokens, "padded_tokens": len(rollouts) * max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))}
    padded_teacher = TeacherScorer(teacher, precision=precision)
    scores = padded_teacher.score(prompts, completions)
    try:
        packed_teacher = TeacherScorer(teacher, packing=True, precision=precision)
        sides = {"padded": lambda: padded_teacher.score(prompts, completions), "packed": lambda: packed_teacher.score(prompts, completions)}
        out["teacher_scoring"] = summary(alternate(sides, repeats), "padded", "packed", tokens)
    except PackingError as err:
        out["teacher_scoring"] = {"not_supported": str(err)}
    cells = [cell_of(r.task) for r in rollouts]
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), full_vocab_kl=False, importance={"mode": "none"}, teacher_actors=False,
                       precision=precision)  # fmt: skip
    try:
        packed = Student.load(student, spec.model_copy(update={"packing": True}), reference_dir=student)
    except PackingError as err:
        out["train_step"] = {"not_supported": str(err)}
        return out
    padded = Student.load(student, spec, reference_dir=student)
    steps = {"padded": lambda: padded.train_step(rollouts, scores, cells), "packed": lambda: packed.train_step(rollouts, scores, cells)}
    out["train_step"] = summary(alternate(steps, repeats), "padded", "packed", tokens)
    return out


def full_head_trained_logits(model, batch):
    """`Student.trained_logits` as before 89abd11: the head over every position, prompts too."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    row_of = torch.arange(logits.shape[0] * logits.shape[1]).view(logits.shape[:2])
    return logits.flatten(0, 1), row_of.gather(1, batch.positions)[batch.mask.bool()]


def whole_tensor_full_vocab_loss(student: Student, batch, scores, orm, weights):
    """The exact-KL loss as it was before the fused `vocab_reverse_kl`: every completion position's logits
    gathered, log-softmaxed and compared over whole [B, T, V] tensors. `weights`: [B, T] token weights."""
    spec = student.spec
    with autocast(student.model.device, spec.precision):
        logits = Student.completion_logits(student.model, batch)
    train = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens[..., None]).squeeze(-1)
    teacher = pad_stack([s.full_logprobs for s in scores], batch.mask.shape[1])
    if student.reference is not None:
        with torch.no_grad(), autocast(student.model.device, spec.precision):
            reference = torch.log_softmax(Student.completion_logits(student.reference, batch).float(), -1)
        teacher = extrapolated_teacher(teacher, reference, spec.reward_scale)
    outcome = mopd_loss(train, batch.rollout_logprobs, train.detach(), batch.mask, importance=spec.importance.mode,
                        orm_advantages=orm, orm_alpha=spec.orm_alpha, token_weights=weights)  # fmt: skip
    return full_vocab_reverse_kl(logits, teacher, batch.mask, weights) + outcome.loss, train


def exact_kl_steps(student: Path, teacher: Path, rollouts: list[Rollout], precision: str) -> tuple[callable, callable, Student]:
    """Two students loaded alike and the exact-KL train step of each on the teacher's full scores of `rollouts`:
    (today's step, the step of the student to change, that student)."""
    scores = TeacherScorer(teacher, precision=precision).score([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts], full=True)
    cells = [cell_of(r.task) for r in rollouts]
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), teacher_actors=False, precision=precision)
    today, changed = (Student.load(student, spec, reference_dir=student) for _ in range(2))
    return (lambda: today.train_step(rollouts, scores, cells)), (lambda: changed.train_step(rollouts, scores, cells)), changed


def bench_head(student: Path, teacher: Path, rollouts: list[Rollout], repeats: int, precision: str) -> dict:
    completion_only, every_position, changed = exact_kl_steps(student, teacher, rollouts, precision)
    changed.trained_logits = full_head_trained_logits
    steps = {"every_position": every_position, "completion_only": completion_only}
    tokens = sum(len(r.prompt_ids) + len(r.token_ids) for r in rollouts)
    prompt_tokens = sum(len(r.prompt_ids) for r in rollouts)
    return {"prompt_tokens": prompt_tokens, **summary(alternate(steps, repeats), "every_position", "completion_only", tokens)}


def bench_fused(student: Path, teacher: Path, rollouts: list[Rollout], repeats: int, precision: str) -> dict:
    """The student's step with the exact KL: whole-tensor (before) against fused over the trained positions."""
    fused, whole_tensor, changed = exact_kl_steps(student, teacher, rollouts, precision)
    changed.full_vocab_loss = functools.partial(whole_tensor_full_vocab_loss, changed)
    steps = {"whole_tensor": whole_tensor, "fused": fused}
    return summary(alternate(steps, repeats), "whole_tensor", "fused", sum(len(r.token_ids) for r in rollouts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--cells", default="general-low,general-high", help="comma-separated cells the prompts come from")
    parser.add_argument("--prompts", type=int, default=8, help="rollouts in the timed batch (one sample per prompt)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side, after one warm-up")
    parser.add_argument("--items", default="scoring,packing", help="comma-separated: scoring, packing, head, fused")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="every side's (distill.precision)")
    parser.add_argument("--threads", type=int, default=1, help="CPUs (and torch threads) the whole process may use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    try:
        check_precision(args.precision, "cpu", "--precision")
    except PrecisionError as err:
        parser.error(str(err))
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    pin(cpus, args.threads)

    rollouts = sample_rollouts(args.student, args.cells.split(","), args.prompts, args.seed, args.max_model_len)
    pin(cpus, args.threads)  # the sampling engine's threads too
    lengths = [len(r.prompt_ids) + len(r.token_ids) for r in rollouts]
    result = {
        "benchmark": "distill items (issue #58): vLLM teacher scoring, packing, the student's head, the fused exact KL",
        "machine": describe_machine(),
        "setup": {**{k: str(v) for k, v in vars(args).items()}, "cpus": cpus, "sequence_lengths": lengths,
                  "completion_tokens": sum(len(r.token_ids) for r in rollouts)},
    }  # fmt: skip
    items = args.items.split(",")
    if "scoring" in items:
        result["scoring"] = bench_scoring(args.teacher, rollouts, args.repeats, args.max_model_len, args.precision)
        pin(cpus, args.threads)
    if "packing" in items:
        result["packing"] = bench_packing(args.student, args.teacher, rollouts, args.repeats, args.precision)
    if "head" in items:
        result["head"] = bench_head(args.student, args.teacher, rollouts, args.repeats, args.precision)
    if "fused" in items:
        result["fused"] = bench_fused(args.student, args.teacher, rollouts, args.repeats, args.precision)
    result["torch_threads_at_end"] = torch.get_num_threads()
    write_json_atomic(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=str))


if __name__ == "__main__":
    main()
