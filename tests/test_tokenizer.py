"""The tiny tokenizer: small vocab, single-id markup, digit-level, lossless, deterministic, saved whole."""

import random

import pytest
from transformers import AutoTokenizer

from mopd.envs.base import DOMAINS, EFFORTS
from mopd.envs.chat import (
    BOS,
    CONTROL_TOKENS,
    EFFORT_TOKENS,
    END,
    SPECIAL_TOKENS,
    SYSTEM,
    TAG_TOKENS,
    TOOL_CALL_OPEN,
    render_prompt,
)
from mopd.envs.tokenizer import VOCAB_SIZE, build_tiny_tokenizer, build_tokenizer, main, task_corpus
from mopd.model.config import K3HybridConfig


@pytest.fixture(scope="module")
def corpus():
    return task_corpus(domains=("general",), tasks_per_cell=100)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return build_tokenizer(corpus)


def test_vocab_fits_the_tiny_model(tokenizer):
    assert len(tokenizer) <= VOCAB_SIZE
    assert len(tokenizer) <= K3HybridConfig().vocab_size


def test_markup_tokens_are_single_ids_and_pad_bos_eos_match_the_model_config(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    config = K3HybridConfig()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
    )
    glued = "".join(SPECIAL_TOKENS)
    assert tokenizer.encode(glued, add_special_tokens=False) == ids


def test_digits_are_split_one_by_one(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        number = str(rng.randint(10**5, 10**9))
        assert tokenizer.tokenize(number) == list(number)


def test_decode_inverts_encode_on_the_corpus_and_on_unseen_text(tokenizer, corpus):
    unseen = [
        "naïve café — ∑ 😀",
        "\ttabs\n\n  spaces ",
        "SELECT * FROM t WHERE x='y';",
        render_prompt("hé", "low"),
    ]
    for text in [*corpus, *unseen]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_skipping_special_tokens_keeps_think_and_tool_tags(tokenizer):
    text = "<|bos|><|user|>q<|end|><|assistant|><|effort:low|><think>a</think><tool_call>b</tool_call><|end|>"
    kept = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert kept == "q<think>a</think><tool_call>b</tool_call>"
    assert all(tag in kept for tag in TAG_TOKENS)
    assert not any(control in kept for control in CONTROL_TOKENS)


def test_the_build_is_deterministic(tokenizer, corpus):
    again = build_tokenizer(list(corpus))
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_saved_tokenizer_reloads_with_its_chat_template_and_ids(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.get_vocab() == tokenizer.get_vocab()
    text = render_prompt("Compute 12 + 30.", "high") + "<think>2+0+0=2</think>42<|end|>"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    rendered = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], effort="low", tokenize=False, add_generation_prompt=True
    )
    assert rendered == render_prompt("hi", "low")


def test_command_builds_and_saves_the_tiny_tokenizer(tmp_path):
    main(["--out", str(tmp_path / "tok"), "--tasks-per-cell", "20"])
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(loaded) <= VOCAB_SIZE
    assert loaded.get_vocab() == build_tiny_tokenizer(tasks_per_cell=20).get_vocab()


def test_the_corpus_holds_expert_transcripts_of_every_domain_and_effort():
    texts = task_corpus(tasks_per_cell=2)
    assert len(texts) == 2 * len(EFFORTS) * len(DOMAINS)
    for marker in ("Compute", "```python", TOOL_CALL_OPEN, SYSTEM, *EFFORT_TOKENS.values()):
        assert any(marker in text for text in texts), marker
    assert all(text.startswith(BOS) and text.endswith(END) for text in texts)
