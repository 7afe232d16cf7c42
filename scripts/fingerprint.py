"""A fingerprint of what a recipe's data and training produce, to show a refactor changed nothing.

    python scripts/fingerprint.py --out FILE.json [--recipes recipes/smoke.yaml recipes/tiny.yaml] [--run-smoke]

Hashes (sha256): the task prompts and meta each domain draws for every split and effort under each
recipe's env options; the smoke recipe's SFT examples (expert transcripts, corruptions, token ids and
loss masks, as `mopd.base.sft.train_base` builds them before fitting); and with `--run-smoke`, every
file a one-thread `mopd run recipes/smoke.yaml` writes that holds data or weights (safetensors,
training records, tokenizer). Run it before and after a change, then compare the two files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS_PER_DRAW = 20


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def task_fingerprints(recipe_path: str) -> dict[str, str]:
    from mopd.envs import get_env
    from mopd.envs.base import DOMAINS, EFFORTS
    from mopd.envs.splits import SPLITS
    from mopd.recipe import load_recipe

    recipe = load_recipe(ROOT / recipe_path)
    out = {}
    for domain in DOMAINS:
        env = get_env(domain, **recipe.env_options(domain))
        for split in SPLITS:
            for effort in EFFORTS:
                try:
                    tasks = env.sample(TASKS_PER_DRAW, 0, split, effort)
                    out[f"{domain}/{split}/{effort}"] = digest([(t.id, t.prompt, t.meta) for t in tasks])
                except ValueError as err:  # a split too small for a family: its message is the fingerprint
                    out[f"{domain}/{split}/{effort}"] = f"error: {err}"
        if hasattr(env, "close"):
            env.close()
    return out


def sft_fingerprint(recipe_path: str) -> str:
    from mopd.base.sft import corrupt_many, expert_transcripts, mix_domains, tokenize_example
    from mopd.envs import get_env
    from mopd.envs.tokenizer import build_tokenizer
    from mopd.recipe import load_recipe

    recipe = load_recipe(ROOT / recipe_path)
    sft = recipe.base.sft
    envs = {domain: get_env(domain, **recipe.env_options(domain)) for domain in mix_domains(sft.mix)}
    transcripts = expert_transcripts(envs, sft.examples, sft.mix, recipe.seed)
    tokenizer = build_tokenizer([text for text, _ in transcripts], sft.vocab_size)
    rng = random.Random(recipe.seed)
    episodes = [episode for _, episode in transcripts]
    noisy = [rng.random() < sft.noise for _ in episodes]
    wrong = corrupt_many(envs, [e if noise else None for e, noise in zip(episodes, noisy, strict=True)], rng)
    examples = [tokenize_example(tokenizer, task, bad or turns, bad is not None, sft.max_length)
                for (task, turns), bad in zip(episodes, wrong, strict=True)]  # fmt: skip
    for env in envs.values():
        if hasattr(env, "close"):
            env.close()
    return digest(examples)


def run_fingerprint() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        command = [sys.executable, "-m", "mopd.cli", "run", "recipes/smoke.yaml", "--out", tmp]
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kept = ("*.safetensors", "trained_on.txt", "trained_text.txt", "tokenizer.json", "sft.json")
        files = sorted({p for pattern in kept for p in Path(tmp).rglob(pattern)})
        return {str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipes", nargs="+", default=["recipes/smoke.yaml", "recipes/tiny.yaml"])
    parser.add_argument("--run-smoke", action="store_true")
    args = parser.parse_args()
    result = {"tasks": {r: task_fingerprints(r) for r in args.recipes}, "sft": {"recipes/smoke.yaml": sft_fingerprint("recipes/smoke.yaml")}}
    if args.run_smoke:
        result["smoke_run"] = run_fingerprint()
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"{args.out}: {digest(result)[:16]}")


if __name__ == "__main__":
    main()
