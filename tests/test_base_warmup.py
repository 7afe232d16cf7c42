"""The base stage beyond SFT from scratch: a pretrained checkpoint warmed up on the experts' transcripts
in its own chat format (`base.warmup`), and the SFT's precision (`base.precision`).

The warm-up runs here on a two-layer llama with a tokenizer that has a chat template and no effort
tokens (what a pretrained model brings); `tests/test_real_model.py` runs it on SmolLM2 itself.
"""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd.artifacts import MetricsLog
from mopd.base.sft import base_checkpoint, build_base, fit, tokenize_example, warm_up
from mopd.bench.run import run_models
from mopd.envs import get_env
from mopd.envs.chat import (
    EFFORT_SYSTEM_LINE,
    NativeChat,
    TemplateChat,
    chat_format,
    render_turns,
    tokenize_segments,
)
from mopd.envs.splits import TRAINED_TEXT, read_trained_on, split_of
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import Recipe, RecipeError, SFTSpec, validate
from tests.fakes import build_llama
from tests.test_precision import LOSS_RTOL

# ChatML, as SmolLM2 and Qwen write it: the kind of template a pretrained model brings
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer with a ChatML template and `<|im_end|>` as its EOS, no effort tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(["What is 12 + 30? <think>12 + 30 = 42</think>42 SELECT name FROM users;"], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>")
    wrapped.chat_template = CHATML
    out = tmp_path_factory.mktemp("chatml") / "tokenizer"
    wrapped.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def pretrained(chatml_tokenizer, tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("pretrained") / "llama", chatml_tokenizer)


def warmup_recipe(checkpoint: Path, **sft) -> Recipe:
    options = {"examples": 12, "steps": 2, "batch_size": 4, "learning_rate": 1e-3, "noise": 0.5, "mix": {"general": 1.0, "agent": 1.0}}
    return Recipe(name="warm", base={"checkpoint": str(checkpoint), "warmup": True, "sft": {**options, **sft}})


# ----------------------------------------------------------------------------- the episode in a model's format
def test_a_native_transcript_is_the_rendered_segments(tiny_tokenizer):
    """`ChatFormat.transcript_ids`, what the warm-up trains on, writes our own markup exactly as the
    from-scratch SFT does (`render_turns`): one prompt, assistant turns, observations between them."""
    chat = chat_format(tiny_tokenizer)
    assert isinstance(chat, NativeChat)
    for domain in ("general", "agent"):
        env = get_env(domain)
        for task in env.sample(3, seed=0, split="train", effort="high"):
            turns = env.solve(task)
            turns = turns if isinstance(turns, list) else [{"role": "assistant", "content": turns}]
            expected = tokenize_segments(tiny_tokenizer, render_turns(task.prompt, turns, task.effort, task.meta.get("system")))
            assert chat.transcript_ids(task, turns) == expected


def test_a_template_transcript_trains_on_the_assistant_turns_and_their_end_token_only(chatml_tokenizer):
    chat = chat_format(chatml_tokenizer)
    assert isinstance(chat, TemplateChat)
    env = get_env("agent")
    task = env.sample(1, seed=0, split="train", effort="low")[0]
    turns = env.solve(task)
    ids, mask = chat.transcript_ids(task, turns, budget=32)
    prompt = chatml_tokenizer.decode(ids[: mask.index(1)])
    assert EFFORT_SYSTEM_LINE.format(effort="low", budget=32) in prompt and prompt.endswith("<|im_start|>assistant\n")
    trained = [token for token, keep in zip(ids, mask, strict=True) if keep]
    replies = [turn["content"] for turn in turns if turn["role"] == "assistant"]
    assert chatml_tokenizer.decode(trained) == "<|im_end|>".join(replies) + "<|im_end|>"
    with pytest.raises(ValueError, match="turn 1: role 'assistant' cannot follow the assistant"):
        chat.transcript_ids(task, [turns[0], turns[0]])


# ----------------------------------------------------------------------------- the warm-up
def test_warmup_needs_a_checkpoint_and_is_refused_naming_the_field():
    with pytest.raises(RecipeError, match=r"r\.yaml: field `base`: .*warmup: warms up a pretrained `base.checkpoint`"):
        validate(Recipe, {"name": "r", "base": {"warmup": True}}, source="r.yaml")
    as_is = Recipe(name="r", base={"checkpoint": "models/x"})
    assert as_is.base.as_is == "models/x" and not as_is.base.trains
    warmed = Recipe(name="r", base={"checkpoint": "models/x", "warmup": True})
    assert warmed.base.as_is is None and warmed.base.trains
    assert base_checkpoint(warmed, Path("runs/r")) == Path("runs/r/base") and base_checkpoint(as_is, Path("runs/r")) == Path("models/x")


def test_warm_up_fine_tunes_the_pretrained_model_on_train_transcripts_in_its_own_format(pretrained, tmp_path):
    recipe = warmup_recipe(pretrained)
    out = tmp_path / "run" / "base"
    out.mkdir(parents=True)
    warm_up(recipe, out)
    steps = [r for r in MetricsLog(out / "metrics.jsonl").records() if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["tokens"] > 0 for r in steps)
    before = AutoModelForCausalLM.from_pretrained(pretrained)
    after = AutoModelForCausalLM.from_pretrained(out)
    assert after.config.model_type == "llama" and not torch.equal(after.lm_head.weight, before.lm_head.weight)
    assert AutoTokenizer.from_pretrained(out).chat_template == CHATML
    assert json.loads((out / "warmup.json").read_text()) == {"checkpoint": str(pretrained.resolve())}
    assert json.loads((out / "sft.json").read_text())["corrupted"] > 0  # noise 0.5: some answers made wrong
    stated = read_trained_on(out, TRAINED_TEXT)
    assert stated and {split_of(key) for key in stated} == {"train"}
    assert [ref.name for ref in run_models(tmp_path / "run")] == ["pretrained", "base"]  # the bench shows both


def test_the_base_stage_warms_up_only_when_asked(pretrained, tmp_path, capsys):
    class Ctx:
        def __init__(self, recipe, directory):
            self.recipe, self.dir = recipe, directory

    assert build_base(Ctx(Recipe(name="r", base={"checkpoint": str(pretrained)}), tmp_path / "as-is")) == {}
    assert json.loads((tmp_path / "as-is" / "base.json").read_text()) == {"checkpoint": str(pretrained.resolve())}
    compute = build_base(Ctx(warmup_recipe(pretrained, steps=1), tmp_path / "warmed"))
    assert compute["tokens_trained"] > 0 and (tmp_path / "warmed" / "model.safetensors").is_file()
    # where a user watches a long warm-up: the stage's working directory, moved into place when it ends
    err = capsys.readouterr().err
    assert f"their metrics go to {tmp_path}/.warmed." in err and "base sft step 1/1 loss" in err


# ----------------------------------------------------------------------------- precision
def sft_loss(precision: str | None, tiny_tokenizer, tmp_path) -> float:
    """The first SFT step's loss of a fixed two-layer K3 model on fixed transcripts."""
    env = get_env("general")
    examples = [tokenize_example(tiny_tokenizer, task, [{"role": "assistant", "content": env.solve(task)}], False, 256)
                for task in env.sample(8, seed=0, split="train", effort="low")]  # fmt: skip
    torch.manual_seed(0)
    model = K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer)))
    log = MetricsLog(tmp_path / f"{precision}.jsonl")
    fit(model, examples, SFTSpec(steps=1, batch_size=8), log, random.Random(0), precision)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 master weights under autocast
    return log.records()[-1]["loss"]


def test_a_bf16_sft_step_matches_fp32_within_bf16_rounding_yet_differs(tiny_tokenizer, tmp_path):
    """The same bound as MOPD's student step (`tests/test_precision.py`): a two-layer model's loss."""
    fp32, bf16 = sft_loss(None, tiny_tokenizer, tmp_path), sft_loss("bf16", tiny_tokenizer, tmp_path)
    assert abs(bf16 - fp32) / abs(fp32) <= LOSS_RTOL and bf16 != fp32


def test_the_base_takes_the_recipes_precision_and_validate_refuses_bf16_where_unsupported(monkeypatch):
    import mopd.precision
    from mopd.validate import check_recipe

    assert Recipe(name="r").base.precision is None  # unset: the tiny recipe's base hash holds
    assert Recipe(name="r", precision="bf16").base.precision == "bf16"
    monkeypatch.setattr(mopd.precision, "bf16_supported", lambda device: False)
    with pytest.raises(RecipeError, match=r"tiny\.yaml: field `base\.precision`: bf16 needs a CPU"):
        check_recipe(str(Path(__file__).parents[1] / "recipes" / "tiny.yaml"), ["base.precision=bf16"])


def test_validate_refuses_a_warmup_of_a_model_without_a_chat_template(pretrained, tmp_path):
    import shutil

    from mopd.validate import check_recipe

    bare = tmp_path / "bare"
    shutil.copytree(pretrained, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nbase: {{checkpoint: {bare}, warmup: true}}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: field `base\.warmup`: .*neither mopd's effort tokens nor a chat template"):
        check_recipe(str(recipe), [])
    recipe.write_text(f"name: r\nbase: {{checkpoint: {pretrained}, warmup: true}}\n")
    assert check_recipe(str(recipe), [])[0].base.warmup
