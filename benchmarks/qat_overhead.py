"""What fake quantization (QAT) adds to a MOPD step's two model-bound phases, side by side in one process.

One student checkpoint, loaded twice: as it is, and computing its routed experts in MX formats
(`routed_expert_mx`, as `distill.qat` makes it). Each repeat times, for both in alternation:

    train    forward + backward of a MOPD micro-batch (rows of the given lengths, sampled-token loss)
    decode   `decode_steps` single-token forwards with the KV/state cache, as the sampler runs them

and the JSON holds each phase's median seconds, QAT ÷ full per phase, and the step ratio weighted by
the phases' shares of a MOPD step (`--train-share`; the rest of the step, teacher scoring, does not
change). Alternating keeps a noisy machine's drift out of the ratios.

    python -m benchmarks.qat_overhead --model runs/tiny-sweep/seed-0/base --out runs/bench/qat_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mopd.artifacts import write_json_atomic
from mopd.machine import describe_machine
from mopd.model import K3HybridForCausalLM
from mopd.model.export import with_routed_expert_mx


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    mx = {"weights": args.experts, "activations": args.activations}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"full": load(args.model), "qat": load(with_routed_expert_mx(args.model, Path(tmp) / "qat", mx))}
    rows = batch(models["full"].config.vocab_size, args.lengths)
    times = {name: {"train": [], "decode": []} for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name]["train"].append(timed(lambda m=model: train_step(m, rows)))
            times[name]["decode"].append(timed(lambda m=model: decode(m, args.decode_steps, len(args.lengths))))
    medians = {name: {phase: statistics.median(v) for phase, v in phases.items()} for name, phases in times.items()}
    ratios = {phase: medians["qat"][phase] / medians["full"][phase] for phase in ("train", "decode")}
    shares = {"train": args.train_share, "decode": args.sample_share}
    step = 1 + sum(shares[p] * (ratios[p] - 1) for p in shares)
    result = {
        "command": "python -m benchmarks.qat_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(args.model), "mx": mx, "lengths": args.lengths, "repeats": args.repeats,
        "decode_steps": args.decode_steps, "median_s": medians, "qat_over_full": ratios,
        "phase_shares": shares, "step_qat_over_full": step, "machine": describe_machine(),
    }  # fmt: skip
    write_json_atomic(args.out, result)
    print(f"QAT ÷ full: train {ratios['train']:.2f}, decode {ratios['decode']:.2f}; a MOPD step {step:.2f}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a K3 student checkpoint")
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4", "mxfp8"])
    p.add_argument("--activations", default="mxfp8", choices=["mxfp4", "mxfp8"])
    p.add_argument("--lengths", type=int, nargs="+", default=[40] * 16 + [300] * 4,
                   help="token lengths of a micro-batch's rows (default: 16 sums and 4 agent episodes)")  # fmt: skip
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--train-share", type=float, required=True,
                   help="the train phase's share of a full-precision MOPD step (time/train ÷ time/step)")  # fmt: skip
    p.add_argument("--sample-share", type=float, required=True,
                   help="the sampling phase's share (time/sample ÷ time/step)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    return p


def load(path: Path) -> K3HybridForCausalLM:
    return K3HybridForCausalLM.from_pretrained(path, dtype=torch.float32)


def batch(vocab: int, lengths: list[int]) -> list[torch.Tensor]:
    return [torch.randint(3, vocab, (n,)) for n in lengths]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(model: K3HybridForCausalLM, rows: list[torch.Tensor]) -> None:
    """Length-sorted rows, padded per micro-batch of similar lengths, as the MOPD trainer batches them."""
    model.train()
    model.zero_grad(set_to_none=True)
    for same_length in group_by_length(rows):
        ids = torch.nn.utils.rnn.pad_sequence(same_length, batch_first=True)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-logp.mean()).backward()


def group_by_length(rows: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for row in rows:
        groups.setdefault(len(row), []).append(row)
    return list(groups.values())


@torch.no_grad()
def decode(model: K3HybridForCausalLM, steps: int, batch_size: int) -> None:
    model.eval()
    for module in model.modules():
        if hasattr(module, "pack_for_inference"):
            module.pack_for_inference()  # as the vLLM plugin does after each weight update: weights rounded once
    ids = torch.randint(3, model.config.vocab_size, (batch_size, 8))
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)


if __name__ == "__main__":
    raise SystemExit(main())
