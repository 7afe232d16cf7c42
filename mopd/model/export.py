"""Export a K3-hybrid checkpoint as an upstream `kimi_linear` checkpoint (config rewrite only).

Weight names already follow the Kimi Linear layout, so the safetensors files are copied as they are
and transformers' `KimiLinearForCausalLM` (and stock vLLM) load them. Kimi Linear has none of K3's
extras, so the export refuses a checkpoint that uses any of them, naming the fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mopd.model.config import K3HybridConfig, read_checkpoint_config


class ExportError(ValueError):
    """The source is not a K3 hybrid checkpoint that the target layout can express."""

# field -> the value a Kimi Linear checkpoint needs, and what it means
KIMI_LINEAR_REQUIREMENTS = {
    "attn_res_block_size": (None, "Block Attention Residuals must be off"),
    "routed_expert_hidden_size": (None, "LatentMoE must be off"),
    "mla_use_output_gate": (False, "the MLA output gate must be off"),
    "q_lora_rank": (None, "vLLM's Kimi Linear MLA needs a plain q_proj"),
    "hidden_act": ("silu", "SiTU is K3-only"),
    "mla_use_nope": (True, "Kimi Linear MLA is NoPE"),
    "moe_router_activation_func": ("sigmoid", "Kimi Linear routes with sigmoid scores"),
}
LINEAR_ATTN_REQUIREMENTS = {
    "use_full_rank_gate": (False, "KDA's full-rank output gate is K3-only"),
    "gate_lower_bound": (None, "KDA's lower-bound gate is K3-only"),
}
K3_ONLY_FIELDS = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "mla_use_output_gate",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "moe_balance",
    "moe_balance_rate",
    "moe_bias_update_speed",
    "full_attn_period",
    "auto_map",
    # PretrainedConfig bookkeeping that a Kimi Linear config.json does not carry
    "_name_or_path",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "problem_type",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "is_encoder_decoder",
)


def export_kimi_linear(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Write `dst_dir`: the checkpoint in `src_dir` with config.json rewritten to `model_type: kimi_linear`."""
    src, dst = Path(src_dir), Path(dst_dir)
    config = K3HybridConfig.from_dict(read_checkpoint_config(src)).to_dict()  # defaults included
    check_kimi_linear_compatible(config, src / "config.json")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(kimi_linear_config(config), indent=2, sort_keys=True) + "\n")
    return dst


def check_kimi_linear_compatible(config: dict, path: Path) -> None:
    problems = [
        f"{field}={config.get(field)!r} ({why}; needs {want!r})"
        for field, (want, why) in KIMI_LINEAR_REQUIREMENTS.items()
        if config.get(field) != want
    ]
    linear = config.get("linear_attn_config", {})
    problems += [
        f"linear_attn_config.{field}={linear.get(field)!r} ({why}; needs {want!r})"
        for field, (want, why) in LINEAR_ATTN_REQUIREMENTS.items()
        if linear.get(field) != want
    ]
    if problems:
        raise ExportError(f"{path}: cannot export as kimi_linear: " + "; ".join(problems))


def kimi_linear_config(config: dict) -> dict:
    out = {k: v for k, v in config.items() if k not in K3_ONLY_FIELDS}
    out["model_type"] = "kimi_linear"
    out["architectures"] = ["KimiLinearForCausalLM"]
    return out
