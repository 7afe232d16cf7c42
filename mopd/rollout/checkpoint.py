"""Random K3 hybrid checkpoints for tests and benchmarks, with every K3 feature exercised.

Fresh init leaves some features inert (zero AttnRes pseudo-queries mix uniformly; a zero router
bias never changes a selection), so those get random values too. The directory also gets a
character-level tokenizer, so `vllm serve` can answer text requests.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from mopd.model import K3HybridForCausalLM, preset_config

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 as in K3HybridConfig


def write_random_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, **overrides) -> K3HybridForCausalLM:
    torch.manual_seed(seed)
    model = K3HybridForCausalLM(preset_config(preset, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("res_proj.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    char_tokenizer(model.config.vocab_size).save_pretrained(out_dir)
    return model


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One id per printable character; the remaining ids decode to "<id>" so any sample has a text."""
    tokens = SPECIAL + [c for c in string.printable if c not in "\x0b\x0c\r"]
    if len(tokens) > vocab_size:
        raise ValueError(f"character tokenizer needs {len(tokens)} ids, the model has {vocab_size}")
    vocab = {token: i for i, token in enumerate(tokens + [f"<{i}>" for i in range(len(tokens), vocab_size)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=SPECIAL[0], bos_token=SPECIAL[1], eos_token=SPECIAL[2]
    )
