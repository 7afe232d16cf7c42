"""Rollout benchmark: the vLLM plugin against HF generate on the same random K3 checkpoints.

    python -m benchmarks.rollout_vllm_vs_hf --out runs/bench/rollout.json

Per preset (tiny ~1M, small ~25M parameters): tokens/s for P prompts x N new tokens (EOS ignored,
temperature 1), each backend in its own fresh process, median over repeats; then resident memory
of one request at a long context (prompt + a few new tokens) per backend, also in fresh processes.
Engine start-up is timed separately and not counted in tokens/s. Both backends run with the same
thread count (--threads, default 1: on a shared 2-core machine extra threads mostly add sync cost).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mopd.machine import describe_machine


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = {"machine": describe_machine(), "workload": vars(args) | {"out": str(args.out)}, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            report["presets"][preset] = bench_preset(preset, Path(tmp) / preset, args)
            write_json(args.out, report)  # partial results survive an interrupted run
    report["crossover"] = crossover(report["presets"])
    write_json(args.out, report)
    print(json.dumps(summary(report), indent=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report path")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per backend (median)")
    parser.add_argument("--memory-context", type=int, default=4096, help="context length of the memory probe; 0 = skip")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per backend process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement in a fresh process
    return parser.parse_args(argv)


def bench_preset(preset: str, ckpt: Path, args: argparse.Namespace) -> dict:
    from mopd.rollout.checkpoint import write_random_checkpoint

    model = write_random_checkpoint(ckpt, preset, seed=0)
    result = {"parameters": sum(p.numel() for p in model.parameters())}
    del model
    throughput = {b: run_worker("throughput", b, ckpt, args) for b in ("hf", "vllm")}
    result["throughput"] = throughput
    result["speedup_vllm_over_hf"] = throughput["vllm"]["tokens_per_s"] / throughput["hf"]["tokens_per_s"]
    if args.memory_context:
        memory = {b: run_worker("memory", b, ckpt, args) for b in ("hf", "vllm")}
        result["memory_at_context"] = memory
        result["memory_ratio_vllm_over_hf"] = memory["vllm"]["peak_rss_mib"] / memory["hf"]["peak_rss_mib"]
    return result


def run_worker(task: str, backend: str, ckpt: Path, args: argparse.Namespace) -> dict:
    command = [
        sys.executable, "-m", "benchmarks.rollout_vllm_vs_hf", "--out", "-", "--worker", f"{task}:{backend}:{ckpt}",
        "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--repeats", str(args.repeats), "--memory-context", str(args.memory_context),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    root = Path(__file__).resolve().parents[1]  # the worker is `-m benchmarks...`: run it from the repository root
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"{task} on {backend} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(spec: str, args: argparse.Namespace) -> dict:
    task, backend, ckpt = spec.split(":", 2)
    return measure_throughput(backend, ckpt, args) if task == "throughput" else measure_memory(backend, ckpt, args)


def measure_throughput(backend: str, ckpt: str, args: argparse.Namespace) -> dict:
    from mopd.rollout.engine import create_engine
    from mopd.rollout.interface import Sampling

    max_len = args.prompt_len + args.new_tokens
    start = time.perf_counter()
    engine = create_engine(ckpt, backend, max_model_len=max_len, max_num_seqs=args.prompts)
    startup = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, engine.config.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    sampling = Sampling(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        samples = engine.generate(prompts, sampling=sampling)
        seconds.append(time.perf_counter() - start)
        assert sum(len(s[0].token_ids) for s in samples) == args.prompts * args.new_tokens
    median = statistics.median(seconds)
    return {
        "startup_s": startup,
        "generate_s": seconds,
        "median_s": median,
        "tokens_per_s": args.prompts * args.new_tokens / median,
    }


def measure_memory(backend: str, ckpt: str, args: argparse.Namespace) -> dict:
    from mopd.rollout.engine import create_engine
    from mopd.rollout.interface import Sampling

    new_tokens = 16
    engine = create_engine(
        ckpt, backend, max_model_len=args.memory_context, max_num_seqs=1,
        kv_cache_memory_bytes=kv_pool_bytes(engine_config(ckpt), args.memory_context),
    )
    loaded = rss_mib()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, engine.config.vocab_size, (args.memory_context - new_tokens,), generator=gen).tolist()
    start = time.perf_counter()
    engine.generate([prompt], sampling=Sampling(max_tokens=new_tokens, ignore_eos=True, seed=0))
    return {
        "context_tokens": args.memory_context,
        "rss_after_load_mib": loaded,
        "peak_rss_mib": peak_rss_mib(),
        "request_growth_mib": peak_rss_mib() - loaded,
        "request_s": time.perf_counter() - start,
    }


def engine_config(ckpt: str):
    from mopd.rollout.interface import load_k3_config

    return load_k3_config(ckpt)


def kv_pool_bytes(config, context: int) -> int:
    """vLLM preallocates its KV pool: size it for one request at `context` (MHA-mode K and V, fp32), x2 slack."""
    mla_layers = config.layer_types.count("full_attention")
    per_token = mla_layers * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * 4
    return 2 * per_token * context + (64 << 20)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def crossover(presets: dict) -> dict:
    """Where the plugin starts beating HF generate, by parameter count (log-linear between presets)."""
    points = sorted((r["parameters"], r["speedup_vllm_over_hf"]) for r in presets.values())
    if points and points[0][1] >= 1:
        return {"parameters": None, "note": f"the plugin is already faster at the smallest size ({points[0][0]} parameters)"}
    for (n0, s0), (n1, s1) in itertools.pairwise(points):
        if s0 < 1 <= s1:
            t = (1 - s0) / (s1 - s0)
            return {"parameters": int(math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))), "note": "log-linear interpolation"}
    return {"parameters": None, "note": "the plugin is not faster than HF at any measured size"}


def summary(report: dict) -> dict:
    return {
        preset: {
            "parameters": r["parameters"],
            "hf_tokens_per_s": round(r["throughput"]["hf"]["tokens_per_s"], 1),
            "vllm_tokens_per_s": round(r["throughput"]["vllm"]["tokens_per_s"], 1),
            "speedup": round(r["speedup_vllm_over_hf"], 2),
            **({"peak_rss_mib": {b: round(m["peak_rss_mib"]) for b, m in r["memory_at_context"].items()}}
               if "memory_at_context" in r else {}),
        }
        for preset, r in report["presets"].items()
    } | {"crossover": report.get("crossover")}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    cli_args = parse_args(sys.argv[1:])
    if cli_args.worker:
        print(json.dumps(worker(cli_args.worker, cli_args)))
    else:
        main(sys.argv[1:])
