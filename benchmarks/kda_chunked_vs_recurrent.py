"""Benchmark: chunked vs recurrent pure-torch KDA on CPU, side by side in one run.

    python -m benchmarks.kda_chunked_vs_recurrent --out runs/bench/kda.json [--seq-len 2048] [--reps 5] [--threads 1]

For each head config, the two kernels run alternately on the same inputs (so both see the same
machine load); the JSON holds their median wall and CPU times, the speed-up ratio, the largest
output difference between them, and a description of the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mopd.machine import describe_machine
from mopd.model.kda import CHUNK_SIZE, chunk_kda, kda_gate, l2norm, recurrent_kda

CONFIGS = [
    {"name": "tiny", "heads": 2, "head_dim": 64, "gate": "k3"},
    {"name": "larger", "heads": 4, "head_dim": 64, "gate": "k3"},
    # Kimi Linear gate with strong decays: the chunked form's exact pairwise fallback
    {"name": "tiny-strong-decay", "heads": 2, "head_dim": 64, "gate": "kimi_strong"},
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5, help="timed runs per kernel (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.reps < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--seq-len, --reps and --threads must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    results = [bench_config(cfg, args.seq_len, args.reps) for cfg in CONFIGS]
    report = {
        "seq_len": args.seq_len, "batch": 1, "chunk_size": CHUNK_SIZE, "reps": args.reps,
        "machine": describe_machine(), "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{r['name']:>18}: recurrent {r['recurrent_wall_s'] * 1e3:8.1f} ms, chunked {r['chunked_wall_s'] * 1e3:7.1f} ms"
            f" -> {r['speedup_wall']:.1f}x wall ({r['speedup_cpu']:.1f}x cpu), max|diff| {r['max_abs_diff']:.1e}"
        )
    print(f"wrote {args.out}")


def bench_config(cfg: dict, seq_len: int, reps: int) -> dict:
    inputs = make_inputs(seq_len, cfg["heads"], cfg["head_dim"], cfg["gate"])
    kernels = {"recurrent": recurrent_kda, "chunked": chunk_kda}
    outputs = {name: kernel(*inputs)[0] for name, kernel in kernels.items()}  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in kernels}
    cpu: dict[str, list[float]] = {name: [] for name in kernels}
    with torch.no_grad():
        for _ in range(reps):
            for name, kernel in kernels.items():
                w0, c0 = time.perf_counter(), time.process_time()
                kernel(*inputs)
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
    med = {f"{name}_{kind}_s": statistics.median(times[name]) for kind, times in (("wall", wall), ("cpu", cpu))
           for name in kernels}
    return {
        **cfg,
        "key_dim": cfg["head_dim"],
        "value_dim": cfg["head_dim"],
        **med,
        "speedup_wall": med["recurrent_wall_s"] / med["chunked_wall_s"],
        "speedup_cpu": med["recurrent_cpu_s"] / med["chunked_cpu_s"],
        "max_abs_diff": (outputs["chunked"] - outputs["recurrent"]).abs().max().item(),
    }


def make_inputs(seq_len: int, heads: int, head_dim: int, gate: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, seq_len, heads, head_dim)
    q, k = (l2norm(torch.randn(shape, generator=gen)) for _ in range(2))
    v = torch.randn(shape, generator=gen)
    f = torch.randn(shape, generator=gen)
    A_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.zeros(heads * head_dim)
    if gate == "k3":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    else:
        g = kda_gate(10 * f + 5, A_log, dt_bias)
    beta = torch.rand(shape[:3], generator=gen)
    return q, k, v, g, beta


if __name__ == "__main__":
    main()
