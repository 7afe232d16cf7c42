"""Recipe YAML: the pydantic schema, teacher specs, command-line overrides and clear errors.

A recipe names the whole pipeline: base → nine teachers → MOPD → benchmark. Teachers are
described by specs in `teachers/<domain>-<effort>.yaml`; a recipe refers to them and may
override any field. Every mistake (bad YAML, unknown key, wrong type) becomes one `RecipeError`
that names the file and the field, raised before any work starts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mopd.envs import check_env_options
from mopd.envs.base import DOMAINS, EFFORTS
from mopd.envs.effort import EffortSpec, default_effort_specs

CELLS: tuple[str, ...] = tuple(f"{d}-{e}" for d in DOMAINS for e in EFFORTS)
Precision = Literal["fp32", "bf16"]
ROOT = Path(__file__).resolve().parent.parent


def sampler_dtype(precision: Precision | None) -> str:
    """A stage's rollout engine dtype: bf16 with a bf16 policy, else fp32 (what the CPU trainer computes)."""
    return "bfloat16" if precision == "bf16" else "float32"


class RecipeError(ValueError):
    """A user mistake in a recipe or spec file; the message names the file and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------- model / base
class ModelSpec(Strict):
    preset: str = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict, description="K3HybridConfig fields")


class SFTSpec(Strict):
    examples: int = Field(3000, gt=0)
    steps: int = Field(300, ge=0)
    batch_size: int = Field(32, gt=0, description="most transcripts per step")
    batch_tokens: int = Field(8192, gt=0, description="most padded tokens per step (short transcripts share a step)")
    learning_rate: float = Field(3e-3, gt=0)
    noise: float = Field(0.1, ge=0.0, le=1.0, description="fraction of traces corrupted, so the base is imperfect")
    mix: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(DOMAINS, 1.0))
    max_length: int = Field(1024, gt=0, description="tokens kept of each transcript")
    vocab_size: int = Field(512, ge=300, description="tokenizer vocabulary (byte-level BPE trained on the transcripts)")

    @model_validator(mode="after")
    def _known_domains(self) -> SFTSpec:
        unknown = [d for d in self.mix if d not in DOMAINS]
        if unknown or not any(w > 0 for w in self.mix.values()):
            raise ValueError(f"mix: needs a positive weight for some of {list(DOMAINS)}; unknown: {unknown}")
        return self


class BaseSpec(Strict):
    checkpoint: str | None = Field(None, description="an existing HF checkpoint; built by SFT when null")
    warmup: bool = Field(
        False, description="with `checkpoint`: fine-tune it by `sft` on the experts' transcripts (train split, in its own "
        "chat template) before RL, so a pretrained model writes each domain's answer format; false: the checkpoint as it is"
    )
    sft: SFTSpec = Field(default_factory=SFTSpec)
    precision: Precision | None = Field(
        None, description="the SFT's forward and backward: bf16 under autocast (fp32 weights and AdamW state), or fp32; "
        "null: the recipe's `precision`"
    )

    @model_validator(mode="after")
    def _warms_up_a_checkpoint(self) -> BaseSpec:
        if self.warmup and self.checkpoint is None:
            raise ValueError("warmup: warms up a pretrained `base.checkpoint`; name one, or leave warmup out (the base is then built by SFT)")
        return self

    @property
    def as_is(self) -> str | None:
        """The recipe's checkpoint where it is the base unchanged; None where the base stage trains one."""
        return None if self.warmup else self.checkpoint

    @property
    def trains(self) -> bool:
        """Whether the base stage trains (SFT from scratch, or the warm-up of a checkpoint)."""
        return self.as_is is None


class Resources(Strict):
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class QATSpec(Strict):
    """Quantization-aware training: the routed experts compute in MX formats in every forward (weights
    and inputs rounded, gradients straight through), while master weights and optimizer state stay
    full precision (`mopd.model.mx`). K3 trains this way so its MXFP4 serving keeps what it learned."""

    experts: Literal["mxfp4", "mxfp8"] | None = Field(None, description="the routed experts' weights (K3: mxfp4)")
    activations: Literal["mxfp4", "mxfp8"] | None = Field(None, description="the routed experts' inputs (K3: mxfp8)")

    @model_validator(mode="after")
    def _quantizes_something(self) -> QATSpec:
        if self.experts is None and self.activations is None:
            raise ValueError("qat: name a format for experts, activations or both (mxfp4, mxfp8), or leave qat out")
        return self

    @property
    def routed_expert_mx(self) -> dict[str, str | None]:
        """The K3 config field (`routed_expert_mx`) that makes a checkpoint compute this way."""
        return {"weights": self.experts, "activations": self.activations}


# ----------------------------------------------------------------------------- teachers
class GRPOSpec(Strict):
    """How a policy trains with GRPO (TRL): shared by the teachers and the mixed-RL baseline."""

    steps: int = Field(20, ge=0)
    prompts_per_step: int = Field(8, gt=0)
    group_size: int = Field(8, gt=1)
    micro_batch_size: int | None = Field(
        None, gt=0, description="rollouts per forward/backward (gradient accumulation); null: a step's all at once"
    )
    learning_rate: float = Field(1e-4, gt=0)
    temperature: float = Field(1.0, gt=0)
    kl_beta: float = Field(0.0, ge=0)
    skip_zero_advantage: bool = Field(
        True, description="train only on rollouts with a non-zero advantage (the same gradient, where the loss allows)"
    )
    importance_sampling: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "none"] = Field(
        "sequence_mask", description="TRL's correction for the sampler/trainer log-prob gap (its default); none: off"
    )
    importance_sampling_cap: float = Field(
        3.0, gt=0, description="sampler/trainer probability ratio above which *_mask drops and *_truncate clips"
    )
    checkpoint_every: int = Field(5, gt=0)
    qat: QATSpec | None = Field(None, description="train a K3 policy with MX-quantized routed experts; null: full precision")
    precision: Precision | None = Field(
        None, description="bf16: TRL's bf16 autocast (fp32 weights and AdamW state) and a bf16 sampler, its gap corrected "
        "by `importance_sampling`; fp32 throughout; null: the recipe's `precision` where it is bf16, else TRL's default "
        "(bf16 on a GPU, fp32 on a CPU)"
    )

    @property
    def sampler_dtype(self) -> str:
        return sampler_dtype(self.precision)

    @model_validator(mode="after")
    def _micro_batches_split_a_step(self) -> GRPOSpec:
        batch = self.prompts_per_step * self.group_size
        if self.micro_batch_size is not None and batch % self.micro_batch_size:
            raise ValueError(f"micro_batch_size {self.micro_batch_size} must divide prompts_per_step × group_size = {batch}")
        return self

    @model_validator(mode="after")
    def _sampler_log_probs_match_the_temperature(self) -> GRPOSpec:
        # The engines report log-probs of the policy at temperature 1; TRL's trainer scores at the spec's.
        if self.importance_sampling != "none" and self.temperature != 1.0:
            raise ValueError(
                f"importance_sampling: {self.importance_sampling} compares the sampler's temperature-1 log-probs "
                f"with the trainer's at temperature {self.temperature}; use temperature: 1.0 or importance_sampling: none"
            )
        return self


class TeacherSpec(GRPOSpec):
    """One (domain, effort) specialist: what it trains on and how (GRPO)."""

    domain: Literal["general", "agent", "code"]
    effort: Literal["low", "high", "max"]
    init: str = Field("base", description="'base' or the path of an HF checkpoint")
    budget_tokens: int | None = Field(None, gt=0, description="defaults to the recipe's effort budget")
    length_penalty: float | None = Field(None, ge=0.0)
    families: list[str] = Field(default_factory=list, description="task families; empty = all of the domain")
    difficulty: dict[str, Any] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.2))
    max_restarts: int = Field(2, ge=0, description="times Ray restarts a teacher's dead actor and retries the cell (from its last checkpoint)")
    eval_tasks: int = Field(32, ge=0, description="held-out tasks scored for base vs teacher; 0 skips")
    eval_samples: int = Field(2, gt=0, description="samples per held-out task")

    @property
    def cell(self) -> str:
        return f"{self.domain}-{self.effort}"

    @property
    def source(self) -> str:
        return f"teachers/{self.cell}.yaml"


class TeachersSpec(Strict):
    spec_dir: str = Field("teachers", description="folder of <domain>-<effort>.yaml specs")
    cells: list[str] = Field(default_factory=lambda: list(CELLS))
    common: dict[str, Any] = Field(default_factory=dict, description="overrides applied to every cell")
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per cell, any spec field")

    @model_validator(mode="after")
    def _known_cells(self) -> TeachersSpec:
        for cell in [*self.cells, *self.overrides]:
            if cell not in CELLS:
                raise ValueError(f"unknown teacher cell {cell!r}; cells are {', '.join(CELLS)}")
        return self


# ----------------------------------------------------------------------------- MOPD
class ImportanceSpec(Strict):
    mode: Literal["icepop", "tis", "none"] = "icepop"
    low: float = Field(0.5, gt=0)
    high: float = Field(5.0, gt=0)


class DistillSpec(Strict):
    student: str | None = Field(None, description="HF checkpoint of the student; null: the base stage's")
    teachers: dict[str, str] = Field(default_factory=dict, description="cell → teacher checkpoint; default: the teacher stage's")
    mix: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(CELLS, 1.0), description="cell → weight")
    steps: int = Field(30, ge=0)
    prompts_per_step: int = Field(16, gt=0)
    samples_per_prompt: int = Field(1, gt=0)
    learning_rate: float = Field(1e-4, gt=0)
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="constant: `learning_rate` every step; cosine: `learning_rate` at step 1, down by half a cosine toward 0 at `steps`"
    )
    max_grad_norm: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, gt=0, description="student sampling; teachers always score at 1")
    importance: ImportanceSpec = Field(default_factory=ImportanceSpec)
    full_vocab_kl: bool = Field(
        True, description="exact reverse KL over the vocabulary (held-out KL 0.047 vs 0.063 for the sampled-token loss at the same speed, tiny pair); keeps [T, V] teacher log-probs per sequence, so large vocabularies turn it off"
    )
    orm_alpha: float = Field(
        0.0, ge=0, description="weight of the verifier's outcome advantage: the reward minus its prompt's mean (`samples_per_prompt` > 1), else its cell's in the step"
    )
    reward_scale: float = Field(1.0, gt=0, description="ExOPD reward scaling (>1 extrapolates past the teacher)")
    max_staleness: int = Field(0, ge=0, description="policy versions a sample may lag behind; 0: synchronous, ≥ 1: the next step samples while this one trains (one step off, lag ≤ 1); a staler sample is an error")
    sampler_actor: bool = Field(
        False, description="the student's sampling engine in its own Ray actor process (`sampler_num_cpus`): with "
        "`max_staleness` ≥ 1 the next step generates there while this process scores and trains; false: in this process"
    )
    sampler_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved for the sampler actor (`sampler_actor`)")
    rescore: bool = Field(
        True, description="the sampled-token advantage log πT − log πθ takes log πθ from this step's forward of the current student; false: the sampler's log-probs recorded when the sample was drawn (stale by the sample's lag; kept to measure rescoring)"
    )
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="padded tokens per train micro-batch, rollouts sorted by length; null: one batch"
    )
    packing: bool = Field(
        False, description="the student's forward/backward and HF teacher scoring run on packed rows (short sequences back to "
        "back with restarting position ids in rows as wide as the longest, instead of padding; `micro_batch_tokens` then "
        "counts real tokens); needs models "
        "whose attention honours packed position ids (transformers' llama and the like: checked at load), not the K3 hybrid"
    )
    scoring: Literal["hf", "vllm"] = Field(
        "hf", description="how teachers score: hf: a chunked HF forward (the only engine for `full_vocab_kl`); vllm: a "
        "prefill in a vLLM engine per teacher (`prompt_logprobs`: the sampled token's log-prob, or a top-k)"
    )
    checkpoint_every: int = Field(5, gt=0)
    teacher_actors: bool = Field(True, description="score with one Ray actor per teacher; false: in-process")
    teacher_num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved per teacher actor")
    teacher_num_gpus: float = Field(0.0, ge=0, description="GPUs per teacher actor (used when the recipe runs on cuda)")
    max_resident_teachers: int | None = Field(
        None, gt=0, description="teachers whose weights are loaded at once (LRU; the rest in CPU memory, or on disk on CPU); null: all"
    )
    trainer_workers: int = Field(1, ge=1, description="FSDP2 ranks the student trains on, one Ray actor each (and a GPU on cuda); 1: in-process")
    eval_tasks: int = Field(0, ge=0, description="held-out tasks per cell scored for student and teacher (eval.json)")
    curve_every: int | None = Field(
        None, gt=0, description="steps between learning-curve snapshots (`curve/step-N/`, scored by the `curves` stage); null: none"
    )
    balance_tokens: bool = Field(
        False, description="each cell's loss is its tokens' mean, weighted by the cell's share of the step's prompts (a cell with short answers weighs as much as one with long episodes); false: the mean over all the step's tokens"
    )
    allocation: Literal["static", "gap"] = Field(
        "static", description="how each step's prompts are split over cells: static: by `mix`; gap: in proportion to the student's reverse KL to each cell's teacher on its recent samples (the mix until measured), above `allocation_floor`"
    )
    allocation_every: int = Field(4, gt=0, description="allocation: gap: steps between re-allocations; each uses the reverse KL of the steps before it")
    allocation_floor: int = Field(1, ge=0, description="allocation: gap: prompts every cell of the mix gets each step, whatever its gap")
    precision: Precision | None = Field(
        None, description="the student's forward and backward and the teachers' scoring: bf16 under autocast (fp32 weights, "
        "AdamW state and log-probs), fp32 throughout; null: the recipe's `precision`"
    )
    qat: QATSpec | None = Field(
        None, description="MOPD with the K3 student's routed experts in MX formats (the sampler computes the same way); null: full precision"
    )

    @property
    def scores_a_reference(self) -> bool:
        """ExOPD (`reward_scale` != 1): the frozen initial student scores every trained sequence too."""
        return self.reward_scale != 1.0

    @model_validator(mode="after")
    def _known_cells(self) -> DistillSpec:
        unknown = [c for c in [*self.mix, *self.teachers] if c not in CELLS]
        if unknown:
            raise ValueError(f"unknown cells {unknown} in mix/teachers; cells are {', '.join(CELLS)}")
        return self

    @model_validator(mode="after")
    def _floor_fits(self) -> DistillSpec:
        cells = sum(1 for weight in self.mix.values() if weight > 0)
        if self.allocation == "gap" and self.allocation_floor * cells > self.prompts_per_step:
            raise ValueError(
                f"allocation_floor: {self.allocation_floor} prompts for each of the mix's {cells} cells is more than "
                f"prompts_per_step ({self.prompts_per_step})"
            )
        return self

    @model_validator(mode="after")
    def _vllm_scores_sampled_tokens(self) -> DistillSpec:
        if self.scoring == "vllm" and self.full_vocab_kl:
            raise ValueError(
                "scoring: vllm needs full_vocab_kl: false (vLLM returns the sampled token's log-prob or a top-k, "
                "not the full-vocabulary distribution the exact KL needs; scoring: hf computes it)"
            )
        return self

    @model_validator(mode="after")
    def _packing_in_process(self) -> DistillSpec:
        if self.packing and self.trainer_workers > 1:
            raise ValueError("packing: true trains in one process; trainer_workers > 1 (FSDP2) trains on padded batches")
        return self

    @model_validator(mode="after")
    def _rescore_needs_sampled_tokens(self) -> DistillSpec:
        if not self.rescore and self.full_vocab_kl:
            raise ValueError("rescore: false needs full_vocab_kl: false (the exact KL is always taken under the current student)")
        return self


# ----------------------------------------------------------------------------- baselines
class MixedRLSpec(GRPOSpec):
    """One GRPO run from the base over the prompts of the cells, evenly mixed, each at its own effort,
    in the pipeline's process. Its GRPO fields default to the recipe's `teachers.common`, then to a
    teacher spec's defaults."""

    steps: int | None = Field(None, ge=0, description="null: until its FLOP estimate matches teachers + MOPD")
    max_steps: int = Field(10_000, gt=0, description="the most steps a matched run may take")
    cells: list[str] = Field(default_factory=lambda: list(CELLS), description="the cells whose prompts it trains on")
    curve_every: int | None = Field(
        None, gt=0, description="steps between learning-curve snapshots (`curve/step-N/`, scored by the `curves` stage); null: none"
    )

    @model_validator(mode="after")
    def _known_cells(self) -> MixedRLSpec:
        unknown = [c for c in self.cells if c not in CELLS]
        if unknown or not self.cells:
            raise ValueError(f"cells: needs some of {', '.join(CELLS)}; unknown: {unknown}")
        return self

    @property
    def source(self) -> str:
        return "baselines.mixed_rl"


class BaselinesSpec(Strict):
    """Models trained beside the pipeline for comparison; `baselines: [mixed_rl]` enables one with its defaults."""

    mixed_rl: MixedRLSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return {name: {} for name in data} if isinstance(data, list) else data


# ----------------------------------------------------------------------------- bench / recipe
class BenchSpec(Strict):
    """The `bench` stage: the run's base, teachers (each on its own cell) and student on a suite."""

    suite: str = Field("eval/tiny.yaml", description="benchmark suite YAML (its split, seeds, domains, efforts)")
    external: list[str] = Field(
        default_factory=list,
        description="external suites (eval/humaneval.yaml, eval/bfcl.yaml, eval/gsm.yaml) benchmarked after `suite`, "
        "each into bench/<its file name>/; `samples`, `temperature` and the workers apply to them too",
    )
    n: int | None = Field(None, gt=0, description="tasks per cell and seed; null = the suite's")
    samples: int | None = Field(None, gt=0, description="samples per task (k of mean@k / pass@k); null = the suite's")
    temperature: float | None = Field(None, ge=0, description="null = the suite's")
    backend: Literal["vllm", "hf"] | None = Field(None, description="rollout engine; null = the recipe's `rollout`")
    workers: int = Field(1, ge=1, description="engines answering (model, cell) jobs at once, one Ray actor each")
    resources: Resources = Field(default_factory=Resources, description="what each worker holds (threads = num_cpus)")


class CurvesSpec(Strict):
    """The `curves` stage: the student's and the mixed-RL baseline's snapshots (`curve_every`) on a dev
    suite, against training compute, and the compute each took to reach `target` of the teachers."""

    suite: str = Field("eval/tiny-dev.yaml", description="a dev suite: curves choose nothing, but are read to compare methods, never on test")
    n: int | None = Field(None, gt=0, description="tasks per cell; null = the suite's")
    target: float = Field(0.9, gt=0, description="the share of the teachers' pooled dev accuracy a model must reach")
    workers: int = Field(1, ge=1, description="engines answering (model, cell) jobs at once, one Ray actor each")
    resources: Resources = Field(default_factory=Resources, description="what each worker holds (threads = num_cpus)")


class SandboxSpec(Strict):
    allow_degraded: bool = Field(
        False, description="without a working bubblewrap, judge code in the weaker rlimit sandbox (labelled) instead of refusing"
    )


class RaySpec(Strict):
    address: str | None = Field(None, description="ray.init address; null starts a local Ray")
    num_cpus: int | None = Field(None, gt=0)


class Recipe(Strict):
    name: str
    seed: int = 0
    runs_dir: str = "runs"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    rollout: Literal["vllm", "hf"] = "vllm"
    max_model_len: int = Field(
        2048, gt=0, description="tokens a rollout engine holds per sequence: the prompt and, in an agent episode, every turn so far; each effort's turn must fit with a prompt"
    )
    ray: RaySpec = Field(default_factory=RaySpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    efforts: dict[Literal["low", "high", "max"], EffortSpec] = Field(default_factory=default_effort_specs)
    envs: dict[Literal["general", "agent", "code"], dict[str, Any]] = Field(default_factory=dict)
    base: BaseSpec = Field(default_factory=BaseSpec)
    teachers: TeachersSpec = Field(default_factory=TeachersSpec)
    distill: DistillSpec = Field(default_factory=DistillSpec)
    baselines: BaselinesSpec = Field(default_factory=BaselinesSpec)
    bench: BenchSpec = Field(default_factory=BenchSpec)
    curves: CurvesSpec | None = Field(None, description="learning curves on dev (`curves` stage); null: none")
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    precision: Precision = Field(
        "fp32", description="what a stage's `precision` is when it sets none (base and distill); bf16 needs a "
        "GPU or a CPU with AVX-512 BF16 or AMX, and is slower than fp32 for a model as small as tiny's"
    )

    @field_validator("envs")
    @classmethod
    def _env_options_exist(cls, envs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for domain, options in envs.items():
            check_env_options(domain, options)
        return envs

    @model_validator(mode="after")
    def _every_effort_has_a_budget(self) -> Recipe:
        missing = [e for e in EFFORTS if e not in self.efforts]
        if missing:
            raise ValueError(f"efforts: missing {missing}; each of {list(EFFORTS)} needs a budget")
        return self

    @model_validator(mode="after")
    def _every_turn_fits_the_engine(self) -> Recipe:
        for effort, spec in self.efforts.items():
            if spec.max_new_tokens >= self.max_model_len:
                raise ValueError(
                    f"efforts.{effort}: a turn of {spec.max_new_tokens} tokens ({spec.budget_tokens} thinking + "
                    f"{spec.answer_tokens} answer + 2 tags) leaves no room for a prompt in max_model_len "
                    f"{self.max_model_len}; raise max_model_len"
                )
        return self

    @model_validator(mode="after")
    def _curves_have_snapshots(self) -> Recipe:
        if self.curves is not None and self.distill.curve_every is None:
            raise ValueError("curves: needs distill.curve_every, the steps between the student's snapshots")
        mixed = self.baselines.mixed_rl
        if self.curves is not None and mixed is not None and mixed.curve_every is None:
            raise ValueError("curves: needs baselines.mixed_rl.curve_every, the steps between the baseline's snapshots")
        return self

    @model_validator(mode="after")
    def _stages_inherit_precision(self) -> Recipe:
        # fp32, what every stage ran in before the setting, stays unset so their stage hashes hold
        if self.precision != "fp32":
            for stage in (self.base, self.distill):
                if stage.precision is None:
                    stage.precision = self.precision
        return self

    def env_options(self, domain: str) -> dict[str, Any]:
        """Keyword options of the domain's env: `envs.<domain>`, and for code the sandbox opt-in."""
        options = dict(self.envs.get(domain, {}))
        if domain == "code" and self.sandbox.allow_degraded:
            options["allow_degraded"] = True
        return options

    def engine_limits(self) -> dict[str, int]:
        """What a stage that samples depends on in its engines beyond the backend: `max_model_len` decides where an
        agent episode ends truncated. Left out at its default, so finished stages of earlier runs stay finished."""
        default = type(self).model_fields["max_model_len"].default
        return {} if self.max_model_len == default else {"max_model_len": self.max_model_len}


# ----------------------------------------------------------------------------- loading
def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe; every mistake is a RecipeError naming file and field."""
    data = read_yaml_mapping(path)
    data = apply_overrides(data, overrides, source=str(path))
    return validate(Recipe, data, source=str(path))


def load_teacher_specs(recipe: Recipe, recipe_dir: Path | None = None) -> dict[str, TeacherSpec]:
    """The recipe's teacher cells, each spec file merged with the recipe's overrides."""
    spec_dir = resolve_path(recipe.teachers.spec_dir, recipe_dir)
    specs = {}
    for cell in recipe.teachers.cells:
        path = spec_dir / f"{cell}.yaml"
        data = deep_merge(read_yaml_mapping(path), recipe.teachers.common)
        data = deep_merge(data, recipe.teachers.overrides.get(cell, {}))
        spec = validate(TeacherSpec, with_precision(data, recipe), source=f"{path} (with recipe overrides teachers.overrides.{cell})")
        if spec.cell != cell:
            raise RecipeError(f"{path}: declares domain/effort {spec.cell!r} but the file is for cell {cell!r}")
        specs[cell] = spec
    return specs


def with_precision(grpo: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """A GRPO policy's fields with the recipe's bf16 `precision` where they set none (fp32 leaves it unset,
    so TRL's default and the stage hashes of earlier runs hold)."""
    return grpo if recipe.precision == "fp32" or "precision" in grpo else {**grpo, "precision": recipe.precision}


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problem = getattr(err, "problem", None) or str(err)
        raise RecipeError(f"{path}: not valid YAML{at}: {problem}") from None
    if data is None:
        raise RecipeError(f"{path}: the file is empty; expected a mapping of recipe fields")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: the top level must be a mapping of fields, got a {type(data).__name__}")
    return data


def validate(model: type[BaseModel], data: dict[str, Any], source: str):
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RecipeError(f"{source}: " + "; ".join(describe(e) for e in err.errors())) from None


def describe(error: dict[str, Any]) -> str:
    field = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"unknown field `{field}`"
    return f"field `{field}`: {error['msg']}"


def apply_overrides(data: dict[str, Any], overrides, source: str) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML). `teachers.CELL.x=v` targets a teacher spec."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override {item!r}: expected KEY=VALUE, e.g. distill.steps=10")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise RecipeError(f"override {item!r}: the value is not valid YAML") from None
        parts = key.split(".")
        if parts[0] == "teachers" and len(parts) > 2 and parts[1] in CELLS:
            parts = ["teachers", "overrides", *parts[1:]]
        set_nested(data, parts, value, item)
    return data


def set_nested(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {item!r}: `{'.'.join(parts[: depth + 1])}` is not a mapping")
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_path(path: str, recipe_dir: Path | None) -> Path:
    """Relative paths resolve against the working directory, then the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    for root in (recipe_dir, ROOT):
        if root is not None and (root / candidate).exists():
            return root / candidate
    return candidate
