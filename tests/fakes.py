"""Fake teachers for developing and testing MOPD without the teacher stage.

A fake teacher is the student's own initial checkpoint after a few supervised steps on one
cell's expert transcripts: it shares the student's tokenizer and architecture, and it is better
than the student on its cell, which is all distillation needs to show that it works.

    python -m tests.fakes --out runs/fake --cells general-low general-high --steps 60
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from mopd.envs import get_env
from mopd.envs.chat import render_turns, tokenize_segments
from mopd.recipe import CELLS

# A small task space (one-digit sums) that a tiny model learns in a few dozen steps.
EASY_ENV_OPTIONS = {"general": {"families": ["add"], "add_digits": [1, 1]}}


def build_student(out: Path, seed: int = 0, **config_overrides) -> Path:
    """A freshly initialised K3 hybrid (tiny preset) with the tiny tokenizer, saved to `out`."""
    from mopd.envs.tokenizer import build_tiny_tokenizer
    from mopd.model import K3HybridForCausalLM, preset_config

    tokenizer = build_tiny_tokenizer(tasks_per_cell=50, seed=seed)
    torch.manual_seed(seed)
    model = K3HybridForCausalLM(preset_config("tiny", vocab_size=len(tokenizer), **config_overrides))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_llama(out: Path, tokenizer, seed: int = 0) -> Path:
    """A freshly initialised two-layer llama (a stock transformers and vLLM architecture) with `tokenizer`, saved to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def seeded_copy(student: Path, out: Path, seed: int) -> Path:
    """The student's architecture and tokenizer with freshly seeded weights (a stand-in teacher)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import mopd.model  # noqa: F401

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(student)).save_pretrained(out)
    AutoTokenizer.from_pretrained(student).save_pretrained(out)
    return out


def sft_on_cell(
    init: Path, out: Path, cell: str, steps: int, env_options: dict | None = None,
    batch_size: int = 16, learning_rate: float = 3e-3, seed: int = 0,
) -> Path:  # fmt: skip
    """`init` trained `steps` supervised steps on the expert transcripts of `cell`, saved to `out`."""
    domain, effort = cell.split("-")
    env = get_env(domain, **(env_options or {}).get(domain, {}))
    tasks = env.sample(batch_size * 8, seed, "train", effort)
    return sft_on_tasks(init, out, tasks, env.solve, steps, batch_size, learning_rate, seed)


def sft_on_tasks(init: Path, out: Path, tasks, solve, steps: int, batch_size=16, learning_rate=3e-3, seed=0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mopd.model  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    examples = [expert_example(task, solve(task), tokenizer) for task in tasks]
    rng = random.Random(seed)
    for _ in range(steps):
        input_ids, labels = pad_examples(rng.sample(examples, min(batch_size, len(examples))), model.config.pad_token_id or 0)
        loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.update_moe_bias()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def echo_rows(n: int, seed: int) -> list[dict]:
    """Task-file rows of a skill a tiny model learns in a few dozen steps: repeat a number."""
    rng = random.Random(seed)
    numbers = [rng.randrange(10, 1000) for _ in range(n)]
    return [{"id": f"echo-{seed}-{i}", "prompt": f"Repeat {x}.", "answer": str(x)} for i, x in enumerate(numbers)]


def echo_solution(task) -> str:
    return f"<think></think>{task.meta['answer']}"


def expert_example(task, solution, tokenizer) -> tuple[list[int], list[int]]:
    turns = solution if isinstance(solution, list) else [{"role": "assistant", "content": solution}]
    return tokenize_segments(tokenizer, render_turns(task.prompt, turns, task.effort, task.meta.get("system")))


def pad_examples(examples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    for i, (ids, mask) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return input_ids, labels


def build_fake_teachers(out: Path, cells: list[str], steps: int, student: Path | None = None, **sft_options) -> dict[str, Path]:
    """A student (unless given) and one SFT-trained fake teacher per cell under `out/teachers/`."""
    student = student or build_student(out / "student")
    return {cell: sft_on_cell(student, out / "teachers" / cell, cell, steps, **sft_options) for cell in cells}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # several times faster than two threads on a shared 2-core machine
    teachers = build_fake_teachers(args.out, args.cells, args.steps, env_options=EASY_ENV_OPTIONS)
    print("\n".join(f"{cell}: {path}" for cell, path in teachers.items()))


if __name__ == "__main__":
    main()
