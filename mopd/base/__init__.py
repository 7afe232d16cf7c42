"""The base model every teacher starts from (SFT on the expert solvers' traces)."""

from mopd.base.sft import base_checkpoint, build_base

__all__ = ["base_checkpoint", "build_base"]
