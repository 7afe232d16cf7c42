"""GRPO corrects for the sampler/trainer gap: TRL weighs each token's loss by its probability ratio,
trainer over sampler, from the log-probs our rollout_func returns (issue #31)."""

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from mopd.model import K3HybridForCausalLM, preset_config
from mopd.recipe import Recipe, RecipeError, TeacherSpec, load_recipe, load_teacher_specs
from mopd.rl.grpo import LengthSortedGRPOTrainer, correct_for_the_sampler, grpo_config, shaped_reward

ROOT = Path(__file__).resolve().parent.parent
# Three groups of two rollouts. The first group ties (advantage 0: left out of the step), so the
# others are reordered by length and cut into micro-batches: their ratios must travel with them.
REWARDS = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
PROMPT_LENGTHS = [3, 5, 4, 2, 6, 3]
COMPLETION_LENGTHS = [5, 3, 7, 6, 4, 8]
OBSERVATION = 2  # completion position of an environment token (env_mask 0, sampler log-prob 0)
OVER_ESTIMATED = (2, [1, 3, 4])  # rollout (advantage > 0), completion positions


class PlantedRollouts:
    """A rollout_func replaying fixed rollouts; the sampler's log-probs are the trainer's own plus `shift`."""

    def __init__(self, vocab_size: int):
        generator = torch.Generator().manual_seed(0)
        self.prompt_ids = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        self.completion_ids = [
            torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in COMPLETION_LENGTHS
        ]
        self.env_mask = [[int(i != OBSERVATION) for i in range(n)] for n in COMPLETION_LENGTHS]
        self.shift = [[0.0] * n for n in COMPLETION_LENGTHS]

    def __call__(self, prompts, trainer):
        logprobs = []
        for prompt, completion, mask, shift in zip(self.prompt_ids, self.completion_ids, self.env_mask, self.shift, strict=True):
            with torch.no_grad():
                logits = trainer.model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            own = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()
            logprobs.append([(lp + s) * m for lp, s, m in zip(own, shift, mask, strict=True)])
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": logprobs,
            "env_mask": self.env_mask,
            "reward": REWARDS,
            "stats": {},
        }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("init")
    torch.manual_seed(0)
    config = preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer))
    K3HybridForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def step(model_dir, tiny_tokenizer, tmp_path, rollouts, **spec_fields):
    """One GRPO step's gradient through our micro-batch path, and the metrics TRL logged for it."""
    spec = TeacherSpec(domain="general", effort="low", prompts_per_step=3, group_size=2, micro_batch_size=2, **spec_fields)
    trainer = LengthSortedGRPOTrainer(
        model=K3HybridForCausalLM.from_pretrained(model_dir),
        reward_funcs=shaped_reward,
        args=grpo_config(spec, Recipe(name="importance"), tmp_path, max_new_tokens=8),
        train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c"]}),
        processing_class=tiny_tokenizer,
        rollout_func=rollouts,
    )
    correct_for_the_sampler(trainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    prompts = [{"prompt": p} for p in "aabbcc"]
    for micro_batch in range(trainer.args.steps_per_generation):
        trainer._step = micro_batch
        trainer._compute_loss(trainer.model, trainer._prepare_inputs(prompts)).backward()
    gradient = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return gradient, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def log_prob_gradient(model_dir, rollouts, row, positions):
    """∇ Σ log p of those tokens of one rollout (the direction that makes them likelier)."""
    model = K3HybridForCausalLM.from_pretrained(model_dir).train()  # as TRL scores
    prompt, completion = rollouts.prompt_ids[row], rollouts.completion_ids[row]
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    logprobs[positions].sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_no_gap_no_correction(model_dir, tiny_tokenizer, tmp_path):
    """The sampler's log-probs are the trainer's own (0 on environment tokens, which are not compared)."""
    rollouts = PlantedRollouts(len(tiny_tokenizer))
    corrected, metrics = step(model_dir, tiny_tokenizer, tmp_path, rollouts)
    plain, plain_metrics = step(model_dir, tiny_tokenizer, tmp_path, rollouts, importance_sampling="none")
    assert metrics["sampling/sampling_logp_difference/mean"] < 1e-5
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-5
    assert metrics["sampling/corrected_fraction"] == 0.0
    assert "sampling/sampling_logp_difference/mean" not in plain_metrics  # off: no extra forward, no gap
    assert plain.abs().sum() > 0
    torch.testing.assert_close(corrected, plain, atol=1e-6, rtol=1e-4)


def test_tokens_the_sampler_over_estimated_move_less(model_dir, tiny_tokenizer, tmp_path):
    rollouts = PlantedRollouts(len(tiny_tokenizer))
    row, positions = OVER_ESTIMATED
    clean, _ = step(model_dir, tiny_tokenizer, tmp_path, rollouts, importance_sampling="token_truncate")
    for p in positions:
        rollouts.shift[row][p] = math.log(4.0)  # sampled at 4x the trainer's probability: weight 1/4
    quarter, metrics = step(model_dir, tiny_tokenizer, tmp_path, rollouts, importance_sampling="token_truncate")
    for p in positions:
        rollouts.shift[row][p] = 50.0  # weight e^-50: as if those tokens were not in the loss
    dropped, _ = step(model_dir, tiny_tokenizer, tmp_path, rollouts, importance_sampling="token_truncate")

    tokens = sum(COMPLETION_LENGTHS) - len(COMPLETION_LENGTHS)  # loss tokens: all but the observations
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(3 * math.log(4.0) / tokens, rel=1e-3)
    assert metrics["sampling/corrected_fraction"] == 0.0  # 1/4 is within the cap: weighted, not truncated
    # The step is linear in a token's weight: those tokens count 1/4 of what they count without the gap.
    torch.testing.assert_close(quarter, 0.25 * clean + 0.75 * dropped, atol=1e-6, rtol=1e-4)
    # The update (−gradient) raises the over-estimated tokens' log-probs less than without the gap.
    likelier = log_prob_gradient(model_dir, rollouts, row, positions)
    assert -clean @ likelier > -quarter @ likelier > -dropped @ likelier
    assert not torch.allclose(clean, dropped)


def test_a_sequence_over_the_cap_is_masked(model_dir, tiny_tokenizer, tmp_path):
    """TRL's default: one ratio per rollout; above the cap (3) the rollout is left out of the loss."""
    rollouts = PlantedRollouts(len(tiny_tokenizer))
    clean, _ = step(model_dir, tiny_tokenizer, tmp_path, rollouts)
    rollouts.shift[3][0] = -math.log(4.0)  # the sampler under-estimated rollout 3: ratio 4 > 3
    masked, metrics = step(model_dir, tiny_tokenizer, tmp_path, rollouts)
    rollouts.shift[3] = [-100.0] * COMPLETION_LENGTHS[3]
    also_masked, _ = step(model_dir, tiny_tokenizer, tmp_path, rollouts)

    tokens = sum(COMPLETION_LENGTHS) - len(COMPLETION_LENGTHS)
    assert metrics["sampling/corrected_fraction"] == pytest.approx((COMPLETION_LENGTHS[3] - 1) / tokens)
    assert not torch.allclose(masked, clean)
    torch.testing.assert_close(masked, also_masked, atol=1e-6, rtol=1e-4)  # a masked rollout weighs 0, however far


def test_the_spec_names_mode_and_cap_and_refuses_a_temperature_it_cannot_correct():
    recipe = load_recipe(ROOT / "recipes/smoke.yaml", ["teachers.common.importance_sampling_cap=2.0"])
    spec = load_teacher_specs(recipe)["code-max"]
    config = grpo_config(spec, recipe, "unused", max_new_tokens=8)
    assert config.vllm_importance_sampling_correction and config.vllm_importance_sampling_mode == "sequence_mask"
    assert config.vllm_importance_sampling_clip_max == 2.0
    off = grpo_config(spec.model_copy(update={"importance_sampling": "none"}), recipe, "unused", max_new_tokens=8)
    assert not off.vllm_importance_sampling_correction
    with pytest.raises(RecipeError, match=r"code-max\.yaml.*temperature 0\.7"):
        load_teacher_specs(load_recipe(ROOT / "recipes/smoke.yaml", ["teachers.code-max.temperature=0.7"]))
    free = ["teachers.common={temperature: 0.7, importance_sampling: none}"]
    assert load_teacher_specs(load_recipe(ROOT / "recipes/smoke.yaml", free))["code-max"].temperature == 0.7
