"""mopd: multi-teacher on-policy distillation (the Kimi K3 post-training recipe).

Importing mopd registers the K3 hybrid (`model_type: k3_hybrid`) with transformers' AutoConfig
and AutoModelForCausalLM, so `AutoModelForCausalLM.from_pretrained(<student dir>)` works.
"""

from mopd import model as model  # registers K3HybridConfig / K3HybridForCausalLM with the Auto classes

__version__ = "0.1.0"
