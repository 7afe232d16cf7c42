"""Attention transfer (LoLCATs' first stage): after `mopd.convert.k3` has made a K3 hybrid from a
Llama-shaped teacher, train only the new mixers (each student layer's KDA or MLA module) to
compute what the teacher's attention computed, before on-policy distillation.

What is trained: every parameter of every student layer's `self_attn` (q/k/v/o projections, short
convolutions, decay and write-strength projections, gates, output norm; MLA's latent projections
and norm). Everything else (embeddings, norms, MLPs) is frozen and stays equal to the teacher's.

Target: per layer, the output of the teacher layer's `self_attn` (after o_proj, before the
residual add) given the teacher's own input to it (its normalised hidden states). With teacher
inputs the layers are independent: each mixer sees exactly what its teacher layer saw, and its
error does not feed the next layer. Loss: per layer the MSE over real (unpadded) tokens and hidden
channels; the layers' losses are summed (their parameters are disjoint, so each layer gets its own
loss's gradient; Adam takes away the scale differences between layers).

Data: the general domain's TRAIN split only (`get_env("general").sample(n, seed, "train", effort)`),
half at low effort, half at high, each rendered by the teacher's chat template
(`chat_format(tokenizer).prompt_ids`) and followed by the teacher's own greedy reply (up to
`continuation` tokens), so the mixers see realistic assistant tokens as well as prompts. A few
more train-split prompts (another seed, with their replies) are held out to measure the per-layer
MSE before and after; dev and test tasks are never read. A layer whose held-out MSE did not fall
gets its converted mixer back (`reverted_layers` in the record).

Optimiser: AdamW (no weight decay), learning rate 1e-3 (best of 3e-4 / 1e-3 / 3e-3 on SmolLM2), a
linear warm-up over the first 5% of the steps and a cosine decay to 0; each step is a minibatch of
`batch_size` sequences of similar length (right-padded: every mixer is causal, so padding after a
sequence changes nothing in it, and the loss ignores it), cycling through the prompts in a seeded
random order. A minibatch's teacher inputs and targets come from one forward of the teacher's base
model (no logits) the first time it is drawn and are kept in bf16 after that: 2 x layers x tokens x
hidden numbers in all (SmolLM2-135M, 200 prompts: 1.2 GB).

Measured (SmolLM2-135M-Instruct, all 30 layers, 200 prompts, 150 steps of 4 sequences, one seed, 8
minutes on one CPU thread): on the teacher's greedy replies to 16 general test-split prompts, forward
KL to the teacher 5.81 -> 0.61 nats/token, reverse KL 11.3 -> 1.06, greedy agreement 4.6% -> 71.5%;
per-layer MSE relative to the target's mean square 0.31-2.35 -> 0.005-0.18. Off by default
(`--transfer-steps 0`): it costs minutes and gigabytes, and the plain conversion stays what it was.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

EFFORTS = ("low", "high")
HELDOUT_PROMPTS = 16
HELDOUT_SEED_OFFSET = 7919  # the held-out prompts: another seed of the train split
WARMUP_FRACTION = 0.05


class TransferError(ValueError):
    """Attention transfer asked for what it cannot do (no tokenizer or chat template, bad sizes)."""


def attention_transfer(
    source, student, kept: list[int], tokenizer, steps: int, prompts: int = 256, lr: float = 1e-3,
    batch_size: int = 4, continuation: int = 32, seed: int = 0, log=None,
) -> dict:  # fmt: skip
    """Train `student`'s mixers (layer i's against teacher layer `kept[i]`) for `steps` AdamW steps
    on `prompts` train-split prompts; returns the record for `init_student.json`."""
    if steps < 1 or prompts < 1 or batch_size < 1 or lr <= 0 or continuation < 0:
        raise TransferError(f"attention transfer: steps {steps}, prompts {prompts}, batch {batch_size}, lr {lr} must be positive")
    if tokenizer is None:
        raise TransferError("attention transfer needs the teacher's tokenizer (and chat template) to build its prompts")
    started = time.time()
    train = transfer_sequences(source, tokenizer, prompts, seed, continuation)
    heldout = transfer_sequences(source, tokenizer, HELDOUT_PROMPTS, seed + HELDOUT_SEED_OFFSET, continuation)
    train_batches, heldout_batches = length_batches(train, batch_size), length_batches(heldout, batch_size)
    mixers = [layer.self_attn for layer in student.model.layers]
    before = layer_mse(source, mixers, kept, heldout_batches)
    converted = [{k: v.clone() for k, v in mixer.state_dict().items()} for mixer in mixers]

    trained = [p for mixer in mixers for p in mixer.parameters()]
    frozen = [p.requires_grad for p in student.parameters()]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    order = torch.Generator().manual_seed(seed)
    queue: list[int] = []
    cache: dict[int, dict[int, tuple[Tensor, Tensor]]] = {}
    try:
        for step in range(steps):
            if not queue:
                queue = torch.randperm(len(train_batches), generator=order).tolist()
            index = queue.pop()
            ids, lengths = train_batches[index]
            if index not in cache:  # the teacher's inputs and outputs of a batch, kept in bf16
                cache[index] = teacher_attention(source, kept, ids, dtype=torch.bfloat16)
            targets = cache[index]
            total = 0.0
            for mixer, j in zip(mixers, kept, strict=True):
                x, y = (t.float() for t in targets[j])
                loss = masked_mse(mixer_output(mixer, x), y, lengths)
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            if log is not None and (step + 1) % max(1, steps // 10) == 0:
                log(f"attention transfer: step {step + 1}/{steps}, summed layer MSE {total:.4g}")
    finally:
        for p, flag in zip(student.parameters(), frozen, strict=True):
            p.requires_grad_(flag)
    after = layer_mse(source, mixers, kept, heldout_batches)
    reverted = [i for i, (b, a) in enumerate(zip(before["mse"], after["mse"], strict=True)) if not a < b]
    for i in reverted:  # kept only where it pays: a layer whose held-out MSE did not fall is put back
        mixers[i].load_state_dict(converted[i])
        after["mse"][i], after["relative"][i] = before["mse"][i], before["relative"][i]
    return {
        "steps": steps, "lr": lr, "batch_size": batch_size, "optimizer": "AdamW, no weight decay, 5% warm-up, cosine to 0",
        "domain": "general", "split": "train", "efforts": list(EFFORTS), "seed": seed,
        "prompts": len(train), "tokens": sum(len(s) for s in train), "continuation_tokens": continuation,
        "heldout_prompts": len(heldout), "heldout_tokens": sum(len(s) for s in heldout),
        "trained": "each layer's self_attn (KDA / MLA), everything else frozen",
        "target": "the teacher layer's self_attn output given its own normalised input (layer-wise, teacher inputs)",
        "mse_before": [round(v, 6) for v in before["mse"]], "mse_after": [round(v, 6) for v in after["mse"]],
        "relative_mse_before": [round(v, 4) for v in before["relative"]],
        "relative_mse_after": [round(v, 4) for v in after["relative"]],
        "reverted_layers": reverted,
        "cached_target_mb": round(sum(t.numel() * t.element_size() for c in cache.values() for xy in c.values() for t in xy) / 2**20, 1),
        "seconds": round(time.time() - started, 1),
    }  # fmt: skip


def lr_factor(step: int, steps: int) -> float:
    warmup = max(1, round(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


# ----------------------------------------------------------------------------- data
@torch.no_grad()
def transfer_sequences(source, tokenizer, n: int, seed: int, continuation: int) -> list[list[int]]:
    """`n` train-split prompts of the general domain (efforts alternating), in the teacher's chat
    format, each followed by up to `continuation` tokens of the teacher's greedy reply."""
    from mopd.envs import get_env
    from mopd.envs.chat import chat_format
    from mopd.envs.effort import effort_spec

    try:
        chat = chat_format(tokenizer)
    except ValueError as err:
        raise TransferError(f"attention transfer: {err}") from None
    env = get_env("general")
    counts = [n // len(EFFORTS) + (k < n % len(EFFORTS)) for k in range(len(EFFORTS))]
    prompts = []
    for k, (effort, count) in enumerate(zip(EFFORTS, counts, strict=True)):
        if count:
            tasks = env.sample(count, seed + k, "train", effort)
            prompts += [chat.prompt_ids(task, effort_spec(effort).budget_tokens) for task in tasks]
    if continuation == 0:
        return prompts
    return [p + reply for p, reply in zip(prompts, greedy_replies(source, prompts, continuation, chat.stop_ids), strict=True)]


@torch.no_grad()
def greedy_replies(source, prompts: list[list[int]], tokens: int, stop_ids: list[int], batch: int = 16) -> list[list[int]]:
    """The teacher's greedy reply to each prompt, cut after its first stop token (left-padded batches)."""
    pad = source.config.pad_token_id if source.config.pad_token_id is not None else stop_ids[0]
    replies: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
        out = source.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, num_beams=1,
            eos_token_id=stop_ids, pad_token_id=pad, temperature=None, top_p=None, top_k=None,
        )[:, width:]  # fmt: skip
        for i, row in zip(chunk, out.tolist(), strict=True):
            stops = [t for t, token in enumerate(row) if token in stop_ids]
            replies[i] = row[: stops[0] + 1] if stops else row
    return replies


def length_batches(sequences: list[list[int]], size: int) -> list[tuple[Tensor, list[int]]]:
    """Minibatches of sequences of similar length, right-padded with token 0: (ids [B, T], lengths)."""
    ordered = sorted(sequences, key=len)
    batches = []
    for start in range(0, len(ordered), size):
        chunk = ordered[start : start + size]
        width = max(len(s) for s in chunk)
        batches.append((torch.tensor([s + [0] * (width - len(s)) for s in chunk]), [len(s) for s in chunk]))
    return batches


# ----------------------------------------------------------------------------- targets and loss
@torch.no_grad()
def teacher_attention(source, kept: list[int], ids: Tensor, dtype=torch.float32) -> dict[int, tuple[Tensor, Tensor]]:
    """Per teacher layer j in `kept`: (its attention input [B, T, D], its attention output [B, T, D]),
    from one forward of the teacher's base model (causal, no padding mask: padding is at the end)."""
    captured: dict[int, tuple[Tensor, Tensor]] = {}
    hooks = []
    for j in kept:

        def take(_module, args, kwargs, output, j=j):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            captured[j] = (x.detach().to(dtype), y.detach().to(dtype))

        hooks.append(source.model.layers[j].self_attn.register_forward_hook(take, with_kwargs=True))
    try:
        source.model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def mixer_output(mixer, x: Tensor) -> Tensor:
    out = mixer(x)
    return out[0] if isinstance(out, tuple) else out  # KDA returns (out, state)


def masked_mse(pred: Tensor, target: Tensor, lengths: list[int]) -> Tensor:
    mask = torch.arange(target.shape[1])[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
    return (pred - target).square().mean(-1)[mask].mean()


@torch.no_grad()
def layer_mse(source, mixers, kept: list[int], batches) -> dict[str, list[float]]:
    """Per student layer: the MSE of its mixer against the teacher's attention output, and that MSE
    over the target's mean square (1 = no better than predicting 0), over all tokens of `batches`."""
    error = [0.0] * len(mixers)
    power = [0.0] * len(mixers)
    tokens = 0
    for ids, lengths in batches:
        targets = teacher_attention(source, kept, ids)
        n = sum(lengths)
        tokens += n
        zero = torch.zeros(ids.shape[0], ids.shape[1], 1)
        for i, (mixer, j) in enumerate(zip(mixers, kept, strict=True)):
            x, y = targets[j]
            error[i] += float(masked_mse(mixer_output(mixer, x), y, lengths)) * n
            power[i] += float(masked_mse(zero, y, lengths)) * n
    mse = [e / tokens for e in error]
    return {"mse": mse, "relative": [e / max(p, 1e-12) for e, p in zip(error, power, strict=True)]}
