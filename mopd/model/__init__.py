"""The K3-style hybrid backbone; importing it registers `k3_hybrid` with transformers' Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from mopd.model.config import (
    PRESETS,
    CheckpointError,
    K3HybridConfig,
    is_k3,
    preset_config,
    read_model_config,
)
from mopd.model.modeling import K3HybridForCausalLM, K3HybridModel, K3HybridPreTrainedModel, active_parameters

AutoConfig.register(K3HybridConfig.model_type, K3HybridConfig, exist_ok=True)
AutoModel.register(K3HybridConfig, K3HybridModel, exist_ok=True)
AutoModelForCausalLM.register(K3HybridConfig, K3HybridForCausalLM, exist_ok=True)

__all__ = [
    "PRESETS",
    "CheckpointError",
    "K3HybridConfig",
    "K3HybridForCausalLM",
    "K3HybridModel",
    "K3HybridPreTrainedModel",
    "active_parameters",
    "is_k3",
    "preset_config",
    "read_model_config",
]
