"""`mopd init-student`: a student that shares its teacher's tokenizer, so the teacher can score the
student's own tokens.

    --arch same --layers N                   N of the teacher's layers, evenly spaced (first and last
                                             kept), every weight copied: the depth-pruned student of
                                             Minitron-style compression
    --arch k3 --preset P --init random       a K3 hybrid of preset P at the teacher's hidden size and
                                             vocabulary, its embeddings (and untied head) copied, the
                                             rest freshly initialised
    --arch k3 --init convert                 a K3 hybrid at the teacher's widths, converted from it:
                                             embeddings, norms and MLPs copied, KDA / MLA mixers made
                                             from its attention projections (`mopd.convert.k3`)
        [--transfer-steps N]                 then N steps of attention transfer: the mixers trained
                                             to match the teacher's per-layer attention outputs on
                                             train-split prompts (`mopd.convert.attention_transfer`)

The directory holds the model, the teacher's tokenizer and chat template, its generation config,
and `init_student.json` saying how it was made.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mopd.artifacts import write_json_atomic
from mopd.model.config import CheckpointError, is_k3, preset_config, read_model_config

LAYER_KEY = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")
PER_LAYER_CONFIG_LISTS = ("layer_types",)  # config fields with one entry per layer (sliding/full attention …)


class StudentInitError(ValueError):
    """A student that cannot be made as asked (bad layer count, unknown preset, teacher not loadable)."""


def init_student(
    teacher: str | Path, out_dir: str | Path, arch: str = "same", layers: int | None = None,
    preset: str = "small", init: str = "random", seed: int = 0,
    transfer_steps: int = 0, transfer_prompts: int | None = None, transfer_lr: float | None = None,
) -> Path:  # fmt: skip
    """Write a student of `teacher` into `out_dir`; returns it. `transfer_steps` > 0 (with `--arch k3
    --init convert`): that many steps of attention transfer (`mopd.convert.attention_transfer`) on
    `transfer_prompts` train-split prompts at learning rate `transfer_lr` (None: the stage's defaults)."""
    from transformers import AutoTokenizer

    check_arch_and_init(arch, init, transfer_steps)
    teacher, out = Path(teacher), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise StudentInitError(f"{out}: exists and is not empty; choose a new directory")
    try:
        config = read_model_config(teacher)
    except CheckpointError as err:
        raise StudentInitError(f"--from {teacher}: {err}") from None
    transfer = {"steps": transfer_steps, "prompts": transfer_prompts, "lr": transfer_lr, "seed": seed}
    torch.manual_seed(seed)
    if arch == "same":
        model, made = depth_pruned(teacher, config, layers)
    elif init == "convert":
        model, made = k3_converted(teacher, config, preset, layers, transfer)
    else:
        model, made = k3_random(teacher, config, preset, layers)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(out)
    write_json_atomic(out / "init_student.json", {"teacher": str(teacher.resolve()), "arch": arch, "seed": seed, **made})
    return out


def check_arch_and_init(arch: str, init: str, transfer_steps: int) -> None:
    """Refuse a combination of --arch, --init and --transfer-steps that names no student, before any file is read."""
    if arch not in ("same", "k3"):
        raise StudentInitError(f"--arch {arch!r}: choose 'same' or 'k3'")
    if init not in ("random", "convert"):
        raise StudentInitError(f"--init {init!r}: choose 'random' or 'convert'")
    if init == "convert" and arch != "k3":
        raise StudentInitError(f"--init convert needs --arch k3 (it converts the teacher into a K3 hybrid; --arch is {arch})")
    if transfer_steps and (arch, init) != ("k3", "convert"):
        raise StudentInitError("--transfer-steps: attention transfer trains converted mixers; use it with --arch k3 --init convert")


# ----------------------------------------------------------------------------- --arch same
def kept_layers(total: int, keep: int) -> list[int]:
    """`keep` layer indices of `total`, evenly spaced, the first and the last always among them."""
    if not 1 <= keep <= total:
        raise StudentInitError(f"--layers {keep}: the teacher has {total} layers; keep between 1 and {total}")
    if keep == 1:
        return [0]
    return [round(i * (total - 1) / (keep - 1)) for i in range(keep)]


def depth_pruned(teacher: Path, config, layers: int | None):
    from transformers import AutoModelForCausalLM

    if layers is None:
        raise StudentInitError("--arch same needs --layers N (how many of the teacher's layers to keep)")
    kept = kept_layers(config.num_hidden_layers, layers)
    source = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    student_config = source.config.__class__.from_dict(source.config.to_dict())
    student_config.num_hidden_layers = len(kept)
    for name in PER_LAYER_CONFIG_LISTS:
        if isinstance(getattr(student_config, name, None), list):
            setattr(student_config, name, [getattr(student_config, name)[i] for i in kept])
    if is_k3(config):  # the K3 layer schedule (KDA / MLA) is per layer too
        student_config.linear_attn_config = pruned_linear_attn(config.linear_attn_config, kept)
    student = AutoModelForCausalLM.from_config(student_config, dtype=torch.float32)
    student.load_state_dict(renumbered(source.state_dict(), kept))
    student.generation_config = source.generation_config
    return student, {"layers": len(kept), "teacher_layers": config.num_hidden_layers, "kept_layers": kept}


def renumbered(state: dict[str, torch.Tensor], kept: list[int]) -> dict[str, torch.Tensor]:
    """The teacher's state dict with layer `kept[i]` renamed layer i and every other layer dropped."""
    new_index = {old: new for new, old in enumerate(kept)}
    out = {}
    for name, tensor in state.items():
        match = LAYER_KEY.match(name)
        if match is None:
            out[name] = tensor
        elif int(match.group(2)) in new_index:
            out[f"{match.group(1)}{new_index[int(match.group(2))]}{match.group(3)}"] = tensor
    return out


def pruned_linear_attn(linear: dict, kept: list[int]) -> dict:
    """K3's 1-based `kda_layers` / `full_attn_layers` lists, renumbered for the kept layers."""
    out = dict(linear)
    for key in ("kda_layers", "full_attn_layers"):
        if key in linear:
            out[key] = [kept.index(layer - 1) + 1 for layer in linear[key] if layer - 1 in kept]
    return out


# ----------------------------------------------------------------------------- --arch k3
def k3_converted(teacher: Path, config, preset: str, layers: int | None, transfer: dict):
    """`--init convert` (`mopd.convert.k3`), then `transfer["steps"]` of attention transfer if asked."""
    from mopd.convert.attention_transfer import TransferError, attention_transfer
    from mopd.convert.k3 import ConversionError, convert_llama_to_k3, load_teacher

    kept = kept_layers(config.num_hidden_layers, config.num_hidden_layers if layers is None else layers)
    source, tokenizer = load_teacher(teacher)
    try:
        student, made = convert_llama_to_k3(source, kept, preset=preset, tokenizer=tokenizer)
    except (ConversionError, KeyError) as err:
        raise StudentInitError(f"--init convert: {err.args[0]}") from None
    if transfer["steps"]:
        options = {k: transfer[k] for k in ("prompts", "lr") if transfer[k] is not None}
        try:
            made["attention_transfer"] = attention_transfer(
                source.eval(), student, kept, tokenizer, transfer["steps"], seed=transfer["seed"], log=print, **options
            )  # fmt: skip
        except TransferError as err:
            raise StudentInitError(f"--transfer-steps: {err}") from None
    return student, made


def k3_random(teacher: Path, config, preset: str, layers: int | None):
    """`--init random`: a K3 hybrid of `preset` at the teacher's widths, its embeddings (and untied head) copied."""
    from transformers import AutoModelForCausalLM

    from mopd.model import K3HybridForCausalLM

    overrides = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "max_position_embeddings": config.max_position_embeddings,
        **({"num_hidden_layers": layers} if layers is not None else {}),
    }
    try:
        student_config = preset_config(preset, **overrides)
    except KeyError as err:
        raise StudentInitError(f"--preset: {err.args[0]}") from None
    source = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    student = K3HybridForCausalLM(student_config)
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(source.get_input_embeddings().weight)
        if not student_config.tie_word_embeddings:
            student.get_output_embeddings().weight.copy_(source.get_output_embeddings().weight)
    student.generation_config = source.generation_config
    return student, {"preset": preset, "init": "random", "layers": student_config.num_hidden_layers, "copied": "embeddings"}

