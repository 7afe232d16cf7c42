"""Benchmark the K3 hybrid on this machine and write JSON.

    python -m benchmarks.model_speed --out runs/bench/model.json [--preset tiny] [--reps 3] [--threads N]

Measures, in one run: training forward+backward tokens/s at T=512 and T=2048 (batch 1), decode
tokens/s through `generate` with the cache, chunked vs recurrent KDA at T=2048 (the KDA
engineer's `kda_chunked_vs_recurrent`, both kernels alternated on the same inputs), and one MoE layer's
forward+backward with every expert run densely vs each expert on its routed tokens, by token count
(where `moe.DENSE_EXPERT_PAIRS` switches between them). Times are medians over
`--reps` runs after one warm-up; the machine description (CPUs, threads, load, torch) comes along.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.kda_chunked_vs_recurrent import CONFIGS as KDA_CONFIGS
from benchmarks.kda_chunked_vs_recurrent import bench_config as bench_kda_config
from mopd.machine import describe_machine
from mopd.model import PRESETS, K3HybridForCausalLM, moe, preset_config

TRAIN_LENGTHS = (512, 2048)
DECODE_PROMPT, DECODE_TOKENS = 64, 64
DECODE_BATCHES = (1, 8)
MOE_TOKENS = (64, 256, 1024, 4096)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (after one warm-up)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--reps and --threads must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = K3HybridForCausalLM(preset_config(args.preset))
    report = {
        "preset": args.preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "reps": args.reps,
        "machine": describe_machine(),
        "train": [bench_training(model, length, args.reps) for length in TRAIN_LENGTHS],
        "decode": [bench_decode(model, batch, args.reps) for batch in DECODE_BATCHES],
        "kda_chunked_vs_recurrent": bench_kda_config(KDA_CONFIGS[0], 2048, args.reps),
        "moe_dense_vs_routed": [bench_moe(model.config, tokens, args.reps) for tokens in MOE_TOKENS],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"wrote {args.out}")


def bench_training(model: K3HybridForCausalLM, length: int, reps: int) -> dict:
    model.train()
    ids = torch.randint(
        3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length)
    )

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()

    seconds = median_seconds(step, reps)
    model.zero_grad(set_to_none=True)
    return {"seq_len": length, "batch": 1, "median_s": seconds, "tokens_per_s": length / seconds}


@torch.no_grad()
def bench_decode(model: K3HybridForCausalLM, batch: int, reps: int) -> dict:
    """Greedy generate of DECODE_TOKENS after a DECODE_PROMPT-token prompt, prefill timed separately."""
    model.eval()
    prompt = torch.randint(
        3, model.config.vocab_size, (batch, DECODE_PROMPT), generator=torch.Generator().manual_seed(1)
    )

    def generate(new_tokens: int) -> None:
        model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )

    prefill = median_seconds(lambda: generate(1), reps)
    total = median_seconds(lambda: generate(DECODE_TOKENS + 1), reps)
    decode = total - prefill
    return {
        "batch": batch,
        "prompt_tokens": DECODE_PROMPT,
        "new_tokens": DECODE_TOKENS,
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tokens_per_s": batch * DECODE_TOKENS / decode,
    }


def bench_moe(config, tokens: int, reps: int) -> dict:
    """One LatentMoE layer, forward+backward on `tokens` tokens: both expert paths, alternated."""
    layer = moe.LatentMoE(config)
    x = torch.randn(tokens, 1, config.hidden_size, generator=torch.Generator().manual_seed(tokens))

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).square().sum().backward()

    paths = {"dense": tokens * config.num_experts, "routed": 0}  # the DENSE_EXPERT_PAIRS that picks each
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    default = moe.DENSE_EXPERT_PAIRS
    try:
        for _ in range(reps):
            for path, threshold in paths.items():
                moe.DENSE_EXPERT_PAIRS = threshold
                seconds[path].append(median_seconds(step, 3))
    finally:
        moe.DENSE_EXPERT_PAIRS = default
    dense, routed = (statistics.median(seconds[path]) for path in paths)
    chosen = "dense" if tokens * config.num_experts <= default else "routed"
    return {"tokens": tokens, "dense_s": dense, "routed_s": routed, "routed_over_dense": routed / dense, "chosen": chosen}


def median_seconds(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_summary(report: dict) -> None:
    for r in report["train"]:
        print(f"train fwd+bwd T={r['seq_len']:>5}: {r['tokens_per_s']:8.0f} tokens/s")
    for r in report["decode"]:
        print(f"decode batch {r['batch']}: {r['decode_tokens_per_s']:8.1f} tokens/s")
    kda = report["kda_chunked_vs_recurrent"]
    print(f"KDA T=2048: chunked {kda['speedup_wall']:.1f}x faster than recurrent")
    for r in report["moe_dense_vs_routed"]:
        print(f"MoE {r['tokens']:>5} tokens: routed / dense {r['routed_over_dense']:.2f} (runs {r['chosen']})")


if __name__ == "__main__":
    main()
