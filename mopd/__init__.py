"""mopd: multi-teacher on-policy distillation (the Kimi K3 post-training recipe).

Importing mopd registers the K3 hybrid (`model_type: k3_hybrid`) with transformers' AutoConfig
and AutoModelForCausalLM, so `AutoModelForCausalLM.from_pretrained(<student dir>)` works.
"""

import logging

# transformers imports torchao (mopd.model.mx's MX formats) at start-up; on a machine without CUDA it
# logs that its CUDA kernels cannot load, and torch logs that torchao registers enums the old way.
# Both are expected there and not the user's to act on.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from mopd import model as model  # noqa: E402  registers K3HybridConfig / K3HybridForCausalLM with the Auto classes

__version__ = "0.1.0"
