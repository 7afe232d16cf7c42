"""`mopd import FILE.gguf OUT`: a GGUF file to an ordinary HF checkpoint directory.

transformers reads a GGUF file (with the `gguf` package) and dequantizes its weights, but marks the
model as quantized, and `save_pretrained` refuses such a model. So the model is rebuilt from its
config without the quantization entry and given the dequantized state dict, then saved as
safetensors beside the tokenizer and its chat template. The result is a plain `model_type`
checkpoint (llama, qwen2, …) that transformers, vLLM and every `mopd` stage load.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class GGUFImportError(ValueError):
    """A file that is not a GGUF checkpoint transformers can read, or an output that would clobber one."""


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Dequantize `gguf_file` into `out_dir` (config.json, model.safetensors, tokenizer, chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, out = Path(gguf_file), Path(out_dir)
    check_paths(source, out)
    kwargs = {"gguf_file": source.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **kwargs)
    except (ValueError, OSError, KeyError) as err:
        raise GGUFImportError(f"{source}: transformers cannot read this GGUF file ({err})") from None
    config = AutoConfig.for_model(**without_quantization(loaded.config.to_dict()))
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check_paths(source: Path, out: Path) -> None:
    if not source.is_file():
        raise GGUFImportError(f"{source}: no such file")
    if source.suffix != ".gguf":
        raise GGUFImportError(f"{source}: not a .gguf file")
    if out.exists() and any(out.iterdir()):
        raise GGUFImportError(f"{out}: exists and is not empty; choose a new directory")


def without_quantization(config: dict) -> dict:
    """The model's config as a plain checkpoint states it: no GGUF quantization entry, no loader-only keys."""
    return {k: v for k, v in config.items() if k not in ("quantization_config", "_name_or_path", "transformers_version")}
