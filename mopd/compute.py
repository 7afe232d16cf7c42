"""Compute accounting: the `compute` block of every stage's `stage.json`.

    flops = 6·N·tokens_trained + 2·N·tokens_sampled + 2·N_teacher·tokens_scored
            (+ 2·N·tokens_trained in MOPD with ExOPD: the frozen initial student scores every trained token)

A token through forward and backward costs ~6 FLOPs per active parameter, through a forward ~2
(attention's cost in the sequence length is left out). N is `mopd.model.active_parameters`: the
parameters a token's forward multiplies by, LatentMoE's routed experts counted top-k of all, the
embedding table left out. Tokens are counted where they are produced:

    tokens_sampled   completion tokens the policy generated (not an agent episode's observations)
    tokens_trained   prompt + completion tokens (padding excluded) through the trainer's forward and backward
    tokens_scored    prompt + completion tokens the teachers' forward ran over (MOPD)

Not counted: other forwards (the prefill of prompts and observations while sampling,
TRL's forward for the sampler/trainer log-prob gap, the KL-to-initial diagnostic, held-out evals).
Training stages log the tokens and `cpu_s` of each step in `metrics.jsonl`, so a resumed stage
counts every step once.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

TOKENS = ("tokens_sampled", "tokens_trained", "tokens_scored")


def estimate_flops(
    tokens_sampled: float, tokens_trained: float, tokens_scored: float, active_params: int, teacher_active_params: int = 0
) -> float:
    return 6 * active_params * tokens_trained + 2 * active_params * tokens_sampled + 2 * teacher_active_params * tokens_scored


def checkpoint_active_parameters(model_dir: str | Path) -> int:
    """`active_parameters` of an HF checkpoint's config. Any other architecture counts all its
    parameters but an untied embedding table (exact for dense models; a routed-MoE model of another
    architecture is over-counted by its inactive experts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mopd.model import active_parameters, is_k3, read_model_config

    config = read_model_config(model_dir)
    if is_k3(config):
        return active_parameters(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head and table are one tensor
    if not config.tie_word_embeddings:
        total -= model.get_input_embeddings().weight.numel()
    return total


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) and of the children it waited for
    (the code sandbox's programs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def steps_compute(
    records: Iterable[Mapping[str, Any]], active_params: int, teacher_active_params: int = 0, wall_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The compute of a training loop from its metrics.jsonl records: tokens and CPU seconds summed
    over the steps, wall seconds summed over `wall_keys`, and the FLOP estimate."""
    records = list(records)
    tokens = {key: int(sum(r.get(key, 0) for r in records)) for key in TOKENS}
    compute = {
        "steps": len(records),
        **tokens,
        "active_params": active_params,
        "teacher_active_params": teacher_active_params,
        "flops": estimate_flops(*(tokens[key] for key in TOKENS), active_params, teacher_active_params),
        "wall_s": round(sum(r.get(key, 0.0) for r in records for key in wall_keys), 1),
    }
    if any("cpu_s" in r for r in records):  # else the pipeline's measure of the whole stage stands
        compute["cpu_s"] = round(sum(r.get("cpu_s", 0.0) for r in records), 1)
        compute["cpu_s_of"] = "training steps: the process running each step and its waited-for children"
    return compute


def total_compute(parts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Several loops' compute added up (a stage's teachers); one N where they share it."""
    params = {key: {part[key] for part in parts.values()} for key in ("active_params", "teacher_active_params")}
    return {
        **{key: sum(part.get(key, 0) for part in parts.values()) for key in ("steps", *TOKENS, "flops", "cpu_s")},
        **{key: values.pop() if len(values) == 1 else sorted(values) for key, values in params.items()},
        "cpu_s_of": "training steps: each teacher's process and its waited-for children",
    }


def device_of(recipe) -> str:
    """Where the stage's tensors ran: "cpu", or the CUDA device's name."""
    cuda = recipe.device == "cuda" or (recipe.device == "auto" and torch.cuda.is_available())
    return f"cuda ({torch.cuda.get_device_name()})" if cuda else "cpu"
