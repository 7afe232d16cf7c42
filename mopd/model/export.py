"""Export a K3-hybrid checkpoint: as an upstream `kimi_linear` checkpoint (config rewrite only), or as
a K3 checkpoint with its routed experts packed in MXFP4 (or computing in MX formats, for QAT).

Weight names already follow the Kimi Linear layout, so the safetensors files are copied as they are
and transformers' `KimiLinearForCausalLM` (and stock vLLM) load them. Kimi Linear has none of K3's
extras, so the export refuses a checkpoint that uses any of them, naming the fields.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mopd.model.config import K3HybridConfig, read_checkpoint_config
from mopd.model.mx import pack_mxfp4


class ExportError(ValueError):
    """The source is not a K3 hybrid checkpoint that the target layout can express."""

# field -> the value a Kimi Linear checkpoint needs, and what it means
KIMI_LINEAR_REQUIREMENTS = {
    "attn_res_block_size": (None, "Block Attention Residuals must be off"),
    "routed_expert_hidden_size": (None, "LatentMoE must be off"),
    "routed_expert_mx": (None, "MX-quantized experts are K3-only"),
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
    "routed_expert_mx",
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


# ----------------------------------------------------------------------------- MX-quantized K3 checkpoints
ROUTED_EXPERT_WEIGHT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def with_routed_expert_mx(src_dir: str | Path, dst_dir: str | Path, mx: dict[str, str | None] | None) -> Path:
    """`dst_dir`: the K3 checkpoint in `src_dir` with its routed experts computing in `mx` (None: full
    precision). The weights are unchanged: a QAT run starts from this, and `--quantize none` serves a
    QAT student at full precision with it."""
    src, dst = Path(src_dir), Path(dst_dir)
    config = read_checkpoint_config(src)
    if "quantization_config" in config:
        raise ExportError(f"{src}: its experts are stored packed ({config['quantization_config'].get('format')}); "
                          "start from the checkpoint it was exported from")
    copy_checkpoint_files(src, dst, skip={"config.json"})
    config["routed_expert_mx"] = mx
    write_config(dst, config)
    return dst


def export_mxfp4(src_dir: str | Path, dst_dir: str | Path, activations: str | None = "mxfp8") -> Path:
    """`dst_dir`: the K3 checkpoint in `src_dir` with every routed expert's weights packed in MXFP4
    (compressed-tensors `mxfp4-pack-quantized`, `mopd.model.mx`) and its inputs computed in
    `activations`. Everything else stays as it was: router, shared experts, attention, norms, embeddings."""
    src, dst = Path(src_dir), Path(dst_dir)
    config = read_checkpoint_config(src)
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ExportError(f"{src}: no *.safetensors weights to quantize")
    copy_checkpoint_files(src, dst, skip={"config.json", "model.safetensors.index.json", *(w.name for w in weights)})
    renamed = {}
    for shard in weights:
        tensors = load_file(shard)
        packed = dict(pack_routed_experts(tensors))
        save_file(packed, dst / shard.name, metadata={"format": "pt"})
        renamed |= {name: shard.name for name in packed}
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = renamed
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if not any(name.endswith(".weight_packed") for name in renamed):
        raise ExportError(f"{src}: no routed expert weights (block_sparse_moe.experts.N.w1/w2/w3) to quantize")
    config["routed_expert_mx"] = {"weights": "mxfp4", "activations": activations}
    config["quantization_config"] = compressed_tensors_mxfp4(activations)
    write_config(dst, config)
    return dst


def pack_routed_experts(tensors: dict[str, torch.Tensor]):
    """(name, tensor) of a shard with each routed expert weight W as W.weight_packed and W.weight_scale."""
    for name, tensor in tensors.items():
        if ROUTED_EXPERT_WEIGHT.search(name):
            packed, scale = pack_mxfp4(tensor)
            stem = name.removesuffix(".weight")
            yield f"{stem}.weight_packed", packed
            yield f"{stem}.weight_scale", scale
        else:
            yield name, tensor


def compressed_tensors_mxfp4(activations: str | None) -> dict:
    """The quantization_config vLLM reads for MXFP4 routed experts (as Kimi K3's checkpoints carry it)."""
    group = {
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8"},
        "input_activations": None if activations is None else {
            "num_bits": 8 if activations == "mxfp8" else 4, "type": "float", "strategy": "group", "group_size": 32,
            "symmetric": True, "dynamic": True},
    }  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


def routed_expert_bytes(model_dir: str | Path) -> dict[str, int]:
    """Bytes of the routed experts' weights as stored in `model_dir`, and what they would take in bf16."""
    stored = bf16 = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118  safe_open has no __iter__
                stem = re.sub(r"\.weight(_packed|_scale)?$", "", name)
                if not ROUTED_EXPERT_WEIGHT.search(stem + ".weight"):
                    continue
                tensor = f.get_tensor(name)
                stored += tensor.numel() * tensor.element_size()
                if not name.endswith(".weight_scale"):
                    values = tensor.numel() * (2 if name.endswith(".weight_packed") else 1)
                    bf16 += values * 2
    return {"stored": stored, "bf16": bf16}


def copy_checkpoint_files(src: Path, dst: Path, skip: set[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in skip:
            shutil.copy2(path, dst / path.name)


def write_config(dst: Path, config: dict) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def qat_start(model_dir: str | Path, mx: dict[str, str | None] | None, out_dir: Path, field: str) -> Path:
    """Where a run with `field` (distill.qat, a teacher's qat) starts: `model_dir` itself without QAT,
    else `out_dir/qat-init`, the same weights computing their routed experts in `mx`."""
    if mx is None:
        return Path(model_dir)
    try:
        config = read_checkpoint_config(model_dir)
    except ValueError as err:
        raise ExportError(f"{field}: QAT quantizes a K3 hybrid's routed experts; {err}") from err
    if not config.get("num_experts"):
        raise ExportError(f"{field}: {model_dir} has no routed experts to quantize")
    start = out_dir / "qat-init"
    if not (start / "config.json").exists() or read_checkpoint_config(start).get("routed_expert_mx") != mx:
        with_routed_expert_mx(model_dir, start, mx)
    return start
