"""vLLM plugin for the K3 hybrid student (entry point `vllm.general_plugins: mopd_k3`).

vLLM calls `register()` in every process it starts, so registration is re-entrant. vLLM itself is
not patched: the config goes into transformers' AutoConfig and vLLM's config registry, the
architecture into vLLM's ModelRegistry (by a lazy "module:Class" string).
"""

ARCHITECTURE = "K3HybridForCausalLM"
MODEL_CLASS = "mopd.vllm_plugin.model:K3HybridForVLLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    from mopd.model.config import K3HybridConfig

    AutoConfig.register(K3HybridConfig.model_type, K3HybridConfig, exist_ok=True)
    _CONFIG_REGISTRY[K3HybridConfig.model_type] = K3HybridConfig
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
