"""The tiny tokenizer: byte-level BPE trained on the expert transcripts of the task domains.

Digits are split one by one (so arithmetic traces line up digit by digit), every chat-markup
token of `mopd.envs.chat` is a single id (pad/bos/eos are 0/1/2), the vocabulary holds at most
512 entries, and the chat template travels with it. Byte-level pieces make decode(encode(x))
the identity on any text. The build is deterministic: the same corpus gives the same vocab.

    python -m mopd.envs.tokenizer --out runs/tokenizer

Real recipes use their base model's tokenizer and chat template instead.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mopd.envs import get_env
from mopd.envs.base import DOMAINS, EFFORTS
from mopd.envs.chat import (
    BOS,
    CHAT_TEMPLATE,
    CONTROL_TOKENS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    render_turns,
)

log = logging.getLogger(__name__)

VOCAB_SIZE = 512
SPECIAL_SPLIT = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def build_tiny_tokenizer(
    domains: Iterable[str] = DOMAINS,
    tasks_per_cell: int = 200,
    seed: int = 0,
    env_options: dict[str, dict] | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> PreTrainedTokenizerFast:
    return build_tokenizer(task_corpus(domains, tasks_per_cell, seed, env_options), vocab_size)


def task_corpus(
    domains: Iterable[str] = DOMAINS,
    tasks_per_cell: int = 200,
    seed: int = 0,
    env_options: dict[str, dict] | None = None,
) -> list[str]:
    """Rendered expert transcripts (prompt + solution) of every domain at every effort."""
    texts = []
    for domain in domains:
        env = get_env(domain, **(env_options or {}).get(domain, {}))
        for effort in EFFORTS:
            tasks = env.sample(tasks_per_cell, seed, "train", effort)
            texts += [transcript_text(env, task) for task in tasks]
    return texts


def transcript_text(env, task) -> str:
    solution = env.solve(task)
    turns = solution if isinstance(solution, list) else [{"role": "assistant", "content": solution}]
    segments = render_turns(task.prompt, turns, task.effort, task.meta.get("system"))
    return "".join(segment.text for segment in segments)


def build_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_plain_pieces(texts), trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    return _wrap(tokenizer)


def _plain_pieces(texts: Iterable[str]) -> Iterable[str]:
    """Corpus text without markup tokens, which must never take part in merges."""
    for text in texts:
        yield from (piece for piece in SPECIAL_SPLIT.split(text) if piece)


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in CONTROL_TOKENS if t not in (BOS, EOS, PAD)],
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder to save_pretrained the tokenizer into")
    parser.add_argument("--tasks-per-cell", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokenizer = build_tiny_tokenizer(tasks_per_cell=args.tasks_per_cell, seed=args.seed)
    tokenizer.save_pretrained(args.out)
    log.info("saved a %d-entry tokenizer to %s", len(tokenizer), args.out)


if __name__ == "__main__":
    main()
