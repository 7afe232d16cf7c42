"""The base model: a tiny K3 hybrid trained from scratch by SFT on the expert solvers' traces, or
a pretrained checkpoint, as it is or warmed up on those traces.

    build_base(ctx)  the pipeline stage: names an existing checkpoint, warms it up, or builds one

Building one: train the tiny tokenizer on the expert transcripts, draw `sft.examples` expert
transcripts over the mix of domains and all three efforts, corrupt a `sft.noise` fraction of them
(one digit of an answer changed, so the base learns a wrong answer some of the time), and
fit the model on the assistant tokens only. The result is an HF checkpoint with the tokenizer
and its chat template: every later stage loads it with `from_pretrained`. Beside it,
`trained_on.txt` lists the content keys of every SFT task and `trained_text.txt` the contents
every example's text states (`mopd.envs.splits`), which `mopd bench` audits its suites against.
Only train contents may appear in that text: a corruption that would state another is passed over,
and an example that states one anyway stops the stage with its task named.

Warming up a pretrained checkpoint (`base.warmup`) fits it the same way on the same transcripts,
written in the checkpoint's own chat format (`mopd.envs.chat.chat_format`: its chat template with
the effort's system line, as every later stage prompts it) with its own tokenizer; `warmup.json`
names the checkpoint it started from, so the bench can show the two side by side.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from mopd.artifacts import MetricsLog, atomic_dir, write_json_atomic
from mopd.compute import checkpoint_active_parameters, steps_compute
from mopd.envs import get_env, text_contents
from mopd.envs.base import EFFORTS, THINK_CLOSE
from mopd.envs.chat import ChatFormat, chat_format, render_turns, tokenize_segments
from mopd.envs.splits import TRAINED_TEXT, split_of, task_keys, trainable, write_trained_on
from mopd.envs.tokenizer import build_tokenizer
from mopd.machine import resolve_device
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.model.config import read_model_config
from mopd.precision import autocast, check_precision

console = Console(stderr=True)
IGNORE = -100


def build_base(ctx) -> dict:
    """Pipeline stage `base`: validate the recipe's checkpoint, or train one into `ctx.dir`; returns
    the compute of its SFT steps (`mopd.compute`; none for an existing checkpoint)."""
    recipe = ctx.recipe
    if recipe.base.checkpoint is not None:
        check_checkpoint(Path(recipe.base.checkpoint), "base.checkpoint")
    if recipe.base.as_is is not None:
        write_json_atomic(ctx.dir / "base.json", {"checkpoint": str(Path(recipe.base.as_is).resolve())})
        return {}
    check_precision(recipe.base.precision, resolve_device(recipe.device), "base.precision")
    with atomic_dir(ctx.dir) as out:
        console.print(f"base: {recipe.base.sft.steps} SFT steps; their metrics go to {out / 'metrics.jsonl'} until the stage ends", soft_wrap=True)
        if recipe.base.warmup:
            warm_up(recipe, out)
        else:
            train_base(recipe, out)
    records = MetricsLog(ctx.dir / "metrics.jsonl").records()
    return steps_compute(records, checkpoint_active_parameters(ctx.dir), wall_keys=("seconds",))


def base_checkpoint(recipe, run_dir: Path) -> Path:
    """Where the base of a run lives: the recipe's checkpoint used as it is, or the `base` stage's directory."""
    return Path(recipe.base.as_is) if recipe.base.as_is is not None else Path(run_dir) / "base"


def check_checkpoint(path: Path, field: str) -> None:
    read_model_config(path)  # any causal LM; raises CheckpointError naming the directory
    if not (path / "tokenizer_config.json").is_file():
        raise ValueError(
            f"{field}: {path} has no tokenizer (tokenizer_config.json); save it beside the model"
        )


# --------------------------------------------------------------------------------------- training
def train_base(recipe, out: Path) -> None:
    sft = recipe.base.sft
    texts, trained, rng = sft_transcripts(recipe, out)
    tokenizer = build_tokenizer(texts, sft.vocab_size)
    examples = [tokenize_example(tokenizer, task, turns, corrupted, sft.max_length) for task, turns, corrupted in trained]
    config = preset_config(recipe.model.preset, vocab_size=len(tokenizer), **recipe.model.overrides)
    torch.manual_seed(recipe.seed)
    model = K3HybridForCausalLM(config)
    fit(model, examples, sft, MetricsLog(out / "metrics.jsonl"), rng, recipe.base.precision)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|end|>", "<|eos|>"])
    save_sft(out, model, tokenizer, examples, sft)


def warm_up(recipe, out: Path) -> None:
    """Fine-tune the pretrained `base.checkpoint` on the experts' transcripts, written in its own chat format."""
    sft, checkpoint = recipe.base.sft, Path(recipe.base.checkpoint)
    _, trained, rng = sft_transcripts(recipe, out)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    chat = chat_format(tokenizer)
    examples = [
        chat_example(chat, task, turns, corrupted, recipe.efforts[task.effort].budget_tokens, sft.max_length)
        for task, turns, corrupted in trained
    ]
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    fit(model, examples, sft, MetricsLog(out / "metrics.jsonl"), rng, recipe.base.precision, pad_id=chat.stop_ids[0])
    save_sft(out, model, tokenizer, examples, sft)
    write_json_atomic(out / "warmup.json", {"checkpoint": str(checkpoint.resolve())})


def sft_transcripts(recipe, out: Path) -> tuple[list[str], list[tuple], random.Random]:
    """The SFT's expert transcripts: their texts (in our markup), and (task, turns, corrupted) of each with a
    `noise` share given a wrong answer digit; writes the tasks and the contents they state to `out`'s records.
    Returns the seeded rng too, which the fit goes on drawing from."""
    sft = recipe.base.sft
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in mix_domains(sft.mix)}
    transcripts = expert_transcripts(envs, sft.examples, sft.mix, recipe.seed)
    write_trained_on(out, task_keys(task for _, (task, _) in transcripts))
    rng = random.Random(recipe.seed)
    episodes = [episode for _, episode in transcripts]
    noisy = [rng.random() < sft.noise for _ in episodes]
    wrong = corrupt_many(envs, [episode if noise else None for episode, noise in zip(episodes, noisy, strict=True)], rng)
    trained = [(task, corrupted or turns, corrupted is not None) for (task, turns), corrupted in zip(episodes, wrong, strict=True)]
    write_trained_on(out, set().union(*(train_contents(task, turns) for task, turns, _ in trained)), TRAINED_TEXT)
    return [text for text, _ in transcripts], trained, rng


def save_sft(out: Path, model, tokenizer, examples: list[dict], sft) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    corrupted = sum(e["corrupted"] for e in examples)
    write_json_atomic(out / "sft.json", {"examples": len(examples), "corrupted": corrupted, **sft.model_dump()})


def mix_domains(mix: dict[str, float]) -> list[str]:
    return [domain for domain, weight in mix.items() if weight > 0]


def sft_tasks(envs: dict[str, Any], examples: int, mix: dict[str, float], seed: int) -> list:
    """The tasks of the base's SFT, from the train split: split by mix weight and evenly over efforts."""
    total = sum(mix[d] for d in envs)
    tasks = []
    for domain, env in envs.items():
        per_effort = max(1, round(examples * mix[domain] / total / len(EFFORTS)))
        for effort in EFFORTS:
            tasks += env.sample(per_effort, seed, "train", effort)
    return tasks


def expert_transcripts(envs: dict[str, Any], examples: int, mix: dict[str, float], seed: int):
    """(text, (task, turns)) pairs: the experts' solutions to the `sft_tasks`, shuffled."""
    out = []
    for task in sft_tasks(envs, examples, mix, seed):
        solution = envs[task.domain].solve(task)
        turns = solution if isinstance(solution, list) else [{"role": "assistant", "content": solution}]
        segments = render_turns(task.prompt, turns, task.effort, task.meta.get("system"))
        out.append(("".join(s.text for s in segments), (task, turns)))
    random.Random(seed).shuffle(out)
    return out


def train_contents(task, turns: list[dict[str, str]]) -> set[str]:
    """The contents an SFT example states (`mopd.envs.text_contents`), all of the train split: the
    generators choose only such text, and an example that states a dev or test content is refused here."""
    text = "".join(segment.text for segment in render_turns(task.prompt, turns, task.effort, task.meta.get("system")))
    keys = text_contents(task.domain, text)
    if not trainable(keys):
        held_out = sorted(f"{key} ({split_of(key)})" for key in keys if split_of(key) != "train")
        raise ValueError(f"SFT example of task {task.id} ({task.domain}-{task.effort}) states held-out contents {held_out}")
    return keys


def tokenize_example(tokenizer, task, turns, corrupted: bool, max_length: int) -> dict:
    segments = render_turns(task.prompt, turns, task.effort, task.meta.get("system"))
    ids, mask = tokenize_segments(tokenizer, segments)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "corrupted": corrupted}


def chat_example(chat: ChatFormat, task, turns, corrupted: bool, budget: int, max_length: int) -> dict:
    """An example in a model's own chat format, prompted as a rollout at the effort's `budget` is."""
    ids, mask = chat.transcript_ids(task, turns, budget)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "corrupted": corrupted}


def corrupt(env, task, turns: list[dict[str, str]], rng: random.Random, tries: int = 10) -> list[dict] | None:
    """One digit changed in an answer (after `</think>`), latest turns first, until the verifier rejects it.

    None when no such change exists (an answer without digits, or only harmless ones).
    """
    return corrupt_many({task.domain: env}, [(task, turns)], rng, tries)[0]


def corrupt_many(envs: dict[str, Any], episodes: list, rng: random.Random, tries: int = 10) -> list:
    """`corrupt` for each (task, turns) episode (None: leave it alone). Each round verifies every
    still-pending episode's next candidate in one batch per domain: the code sandbox runs a batch
    in parallel (the tiny base's data preparation: 74 s one at a time, 37 s in batches)."""
    candidates = [
        [turns for turns in digit_changes(episode[1], rng, tries) if states_only_train(episode[0], turns)] if episode else []
        for episode in episodes
    ]  # a changed digit of code can make a dev or test function: such a change is passed over
    wrong: list[list[dict] | None] = [None] * len(episodes)
    pending = [i for i, options in enumerate(candidates) if options]
    for attempt in range(tries):
        pending = [i for i in pending if attempt < len(candidates[i])]
        rewards = verify_grouped(envs, [(episodes[i][0], candidates[i][attempt]) for i in pending])
        for i, reward in zip(pending, rewards, strict=True):
            if reward < 1.0:
                wrong[i] = candidates[i][attempt]
        pending = [i for i in pending if wrong[i] is None]
    return wrong


def states_only_train(task, turns: list[dict[str, str]]) -> bool:
    return trainable(text_contents(task.domain, "".join(t["content"] for t in turns)))


def digit_changes(turns: list[dict[str, str]], rng: random.Random, tries: int) -> list[list[dict]]:
    """Up to `tries` copies of `turns`, each with one answer digit changed, latest turns first."""
    places = [
        (index, pos)
        for index, turn in enumerate(turns)
        if turn["role"] == "assistant"
        for pos in answer_digits(turn["content"])
    ]
    places.sort(key=lambda place: (-place[0], rng.random()))
    changes = []
    for index, pos in places[:tries]:
        wrong = [dict(t) for t in turns]
        text = wrong[index]["content"]
        digit = rng.choice([d for d in "0123456789" if d != text[pos]])
        wrong[index]["content"] = text[:pos] + digit + text[pos + 1 :]
        changes.append(wrong)
    return changes


def verify_grouped(envs: dict[str, Any], checks: list[tuple[Any, list[dict]]]) -> list[float]:
    """The reward of each (task, turns), one `verify_many` call per domain where the env has one."""
    rewards: list[float] = [0.0] * len(checks)
    by_domain: dict[str, list[int]] = {}
    for i, (task, _) in enumerate(checks):
        by_domain.setdefault(task.domain, []).append(i)
    for domain, indices in by_domain.items():
        env = envs[domain]
        attempts = [checks[i][1] if len(checks[i][1]) > 1 else checks[i][1][0]["content"] for i in indices]
        tasks = [checks[i][0] for i in indices]
        verify_many = getattr(env, "verify_many", None)
        verdicts = verify_many(tasks, attempts) if verify_many else map(env.verify, tasks, attempts)
        for i, verdict in zip(indices, verdicts, strict=True):
            rewards[i] = verdict.reward
    return rewards


def answer_digits(content: str) -> list[int]:
    start = content.rfind(THINK_CLOSE) + len(THINK_CLOSE) if THINK_CLOSE in content else len(content)
    return [pos for pos in range(start, len(content)) if content[pos].isdigit()]


def fit(
    model, examples: list[dict], sft, log: MetricsLog, rng: random.Random, precision: str | None = None, pad_id: int | None = None
) -> None:
    """Next-token loss on assistant tokens (under bf16 autocast when `precision` says so); a K3 model's
    MoE bias updates once per optimizer step. `pad_id`: where the config names none."""
    model.train()
    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else pad_id
    update_moe_bias = getattr(model, "update_moe_bias", dict)  # a K3 hybrid's; other models balance nothing
    # fused: one kernel over all ~370 tensors; its optimizer step takes 5 ms here against 22 ms as a
    # per-tensor loop, though a whole SFT step measured even (0.558 vs 0.563 s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.learning_rate, weight_decay=0.0, fused=True)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, sft.steps // 20), sft.steps)
    batches = length_grouped_batches(examples, sft, rng)
    for step in range(1, sft.steps + 1):
        start = time.time()
        rows = next(batches)
        batch = {key: value.to(device) for key, value in collate(rows, pad_id).items()}
        with autocast(device, precision):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        balance = update_moe_bias()
        log.log(
            step,
            loss=loss.item(),
            lr=schedule.get_last_lr()[0],
            seconds=time.time() - start,
            tokens=int((batch["labels"] != IGNORE).sum()),
            tokens_trained=sum(len(row["input_ids"]) for row in rows),  # padding left out (mopd.compute)
            **balance,
        )
        if step % max(1, min(25, sft.steps // 10)) == 0 or step == sft.steps:
            console.print(f"base sft step {step}/{sft.steps} loss {loss.item():.3f} ({time.time() - start:.1f} s)")
    model.eval()


def length_grouped_batches(examples: list[dict], sft, rng: random.Random, pool: int = 512):
    """Endless batches of similar length in random order, each up to `batch_tokens` padded tokens.

    A sum is ~25 tokens and an agent transcript ~500: padding sums to an agent's length would
    make most of a step padding, and a fixed row count would give sums a tiny share of the
    tokens. Rows are drawn `pool` at a time, sorted by length, and packed greedily.
    """
    while True:
        order = rng.sample(range(len(examples)), len(examples))
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start : start + pool], key=lambda i: len(examples[i]["input_ids"]))
            batches += pack(chunk, [len(examples[i]["input_ids"]) for i in chunk], sft.batch_tokens, sft.batch_size)
        rng.shuffle(batches)
        for indices in batches:
            yield [examples[i] for i in indices]


def pack(indices: list[int], lengths: list[int], max_tokens: int, max_rows: int | None = None) -> list[list[int]]:
    """Consecutive runs of `indices` (sorted by length) whose padded size (rows × longest) fits
    `max_tokens`, at most `max_rows` each; a row longer than `max_tokens` is a run of its own."""
    batches, current = [], []
    for index, length in zip(indices, lengths, strict=True):
        if current and ((len(current) + 1) * length > max_tokens or len(current) == max_rows):
            batches.append(current)
            current = []
        current.append(index)
    return [*batches, current] if current else batches


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right padding: causal attention keeps pads after every real token, and pads carry no loss."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.where(torch.tensor(e["loss_mask"]) == 1, ids[row, :n], IGNORE)
    return {"input_ids": ids, "labels": labels}
