"""Teacher scoring memory and speed: before (a [B, T, V] log-softmax) and after (the chunked LM head).

    python -m benchmarks.teacher_scoring_memory --out runs/bench/scoring.json [--vocab 1024 163840]

For each vocabulary size a synthetic teacher of the tiny shape (random init, fp32) scores one batch
of random prompt + completion ids (default 8 × (64 + 256) tokens: at V = 163,840 the old path's
[B, T, V] fp32 tensor is 1.68 GB, and it held two, logits and log-softmax). "before" is the scorer
as it was (`materialised_score`, kept here as the reference the tests compare against), "after"
is `TeacherScorer.score`. Each measurement is a fresh process (spawned) that loads the teacher,
warms up on one short request, then scores the batch once: its seconds and its peak RSS during
that call (Linux VmHWM, reset just before it; tracemalloc does not see torch's allocations).
Medians over `--repeats` measurements, the before/after ratios, and the machine go to the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import in_fresh_process, reset_peak_rss, rss_bytes
from mopd.artifacts import write_json_atomic
from mopd.distill.scorer import TeacherScorer, TeacherScores, token_budget_batches
from mopd.machine import describe_machine

PATHS = ("before", "after")


@torch.inference_mode()
def materialised_score(
    scorer: TeacherScorer, prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int = 0, full: bool = False
) -> list[TeacherScores]:
    """The scorer before issue #33: the full [B, T, V] fp32 log-softmax of every padded batch."""
    sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    out: list[TeacherScores | None] = [None] * len(sequences)
    for batch in token_budget_batches(sequences, scorer.max_batch_tokens):
        rows = [sequences[i] for i in batch]
        width = max(len(s) for s in rows)
        ids = torch.tensor([s + [scorer.pad_id] * (width - len(s)) for s in rows], device=scorer.device)
        logprobs = torch.log_softmax(scorer.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
        for row, i in enumerate(batch):
            start, n = len(prompt_ids[i]) - 1, len(completion_ids[i])
            positions = logprobs[row, start : start + n].cpu()
            scores = TeacherScores(logprobs=positions.gather(-1, torch.tensor(completion_ids[i])[:, None]).squeeze(-1))
            if top_k:
                scores.topk_logprobs, scores.topk_ids = positions.topk(top_k, dim=-1)
            if full:
                scores.full_logprobs = positions.clone()
            out[i] = scores
    return out  # type: ignore[return-value]


def build_teacher(out: Path, vocab_size: int) -> Path:
    from mopd.model import K3HybridForCausalLM, preset_config

    torch.manual_seed(0)
    K3HybridForCausalLM(preset_config("tiny", vocab_size=vocab_size)).save_pretrained(out)
    return out


def random_requests(vocab_size: int, batch: int, prompt_len: int, completion_len: int) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab_size, (batch, prompt_len), generator=generator).tolist()
    completions = torch.randint(3, vocab_size, (batch, completion_len), generator=generator).tolist()
    return prompts, completions


def measure(teacher: Path, path: str, batch: int, prompt_len: int, completion_len: int, top_k: int, threads: int) -> dict:
    """One scoring call in this (fresh) process: seconds, RSS before it and peak RSS during it."""
    torch.set_num_threads(threads)
    scorer = TeacherScorer(teacher, max_batch_tokens=batch * (prompt_len + completion_len))
    prompts, completions = random_requests(scorer.vocab_size, batch, prompt_len, completion_len)
    score = scorer.score if path == "after" else partial(materialised_score, scorer)
    score(prompts[:1], [completions[0][:8]], top_k)  # warm-up
    reset_peak_rss()
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    score(prompts, completions, top_k)
    seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    return {"seconds": seconds, "rss_before_bytes": before, "peak_rss_bytes": peak, "scoring_extra_bytes": peak - before}


def bench_vocab(vocab_size: int, work: Path, args: argparse.Namespace) -> dict:
    teacher = in_fresh_process(build_teacher, work / f"teacher-{vocab_size}", vocab_size)
    setup = (args.batch, args.prompt_len, args.completion_len, args.top_k, args.threads)
    result: dict = {}
    for path in PATHS:
        runs = [in_fresh_process(measure, teacher, path, *setup) for _ in range(args.repeats)]
        seconds = statistics.median(r["seconds"] for r in runs)
        result[path] = {
            "seconds_median": seconds,
            "completion_tokens_per_s": args.batch * args.completion_len / seconds,
            "peak_rss_bytes_median": statistics.median(r["peak_rss_bytes"] for r in runs),
            "scoring_extra_bytes_median": statistics.median(r["scoring_extra_bytes"] for r in runs),
            "runs": runs,
        }
    before, after = result["before"], result["after"]
    result["before_over_after"] = {
        "peak_rss": before["peak_rss_bytes_median"] / after["peak_rss_bytes_median"],
        "scoring_extra": before["scoring_extra_bytes_median"] / max(after["scoring_extra_bytes_median"], 1),
        "seconds": before["seconds_median"] / after["seconds_median"],
    }
    result["materialised_bytes"] = 4 * args.batch * (args.prompt_len + args.completion_len) * vocab_size
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 163840], help="vocabulary sizes")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the scored batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=0, help="also return the teacher's top-k (0: sampled tokens only)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process measurements per path (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    args = parser.parse_args(argv)
    if min([*args.vocab, args.batch, args.prompt_len, args.completion_len, args.repeats, args.threads]) < 1:
        parser.error("--vocab, --batch, --prompt-len, --completion-len, --repeats and --threads must be positive")
    if args.top_k < 0:
        parser.error("--top-k must be 0 or positive")

    with tempfile.TemporaryDirectory(prefix="mopd-bench-scoring-") as tmp:
        result = {
            "benchmark": "teacher scoring memory and speed, before/after chunked LM head",
            "machine": describe_machine() | {"torch_threads": args.threads},
            "setup": {"preset": "tiny", "batch": args.batch, "prompt_tokens": args.prompt_len,
                      "completion_tokens": args.completion_len, "top_k": args.top_k, "repeats": args.repeats},
            "vocab": {str(v): bench_vocab(v, Path(tmp), args) for v in args.vocab},
        }  # fmt: skip
    write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
