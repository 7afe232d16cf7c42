"""`import mopd` alone registers the K3 hybrid with transformers' Auto classes."""

import subprocess
import sys

CHECK = """
import mopd
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("k3_hybrid", vocab_size=64)
model = AutoModelForCausalLM.from_config(config)
print(type(config).__name__, type(model).__name__)
"""


def test_import_mopd_registers_the_auto_classes():
    shown = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["K3HybridConfig", "K3HybridForCausalLM"]
