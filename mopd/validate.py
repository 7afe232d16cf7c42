"""`mopd validate`: the recipe and every file it names, opened and parsed before any work.

    recipe       schema, overrides                          (mopd.recipe.load_recipe)
    teachers     the spec directory, each cell's spec, each spec's `init` checkpoint
    model        the preset and its overrides build a config (when the base is trained)
    checkpoints  base.checkpoint, distill.student, distill.teachers.*: a directory with a config.json of a
                 causal LM transformers knows (a K3 hybrid or any stock architecture), its weights, and
                 at least `max_model_len` positions (the engines refuse fewer)
    distill      every cell of the mix has a teacher
    bench        the suite loads as `mopd bench` loads it, its envs build with the recipe's options
    curves       the learning curves' suite loads and is a dev suite

`mopd run` calls `check_recipe` first, so a run never stops mid-way on a file the recipe names.
Every mistake is one `RecipeError` naming the recipe file and the field:

    recipes/x.yaml: field `bench.suite`: eval/does_not_exist.yaml: no such file

No weights are loaded: a checkpoint's config.json is parsed and its weight files listed, nothing more.
"""

from __future__ import annotations

import json
from pathlib import Path

from mopd.recipe import Recipe, RecipeError, TeacherSpec, load_recipe, load_teacher_specs, resolve_path


def check_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Recipe, dict[str, TeacherSpec]]:
    """Load the recipe and check everything `mopd run` reads from it; returns the recipe and its teacher specs."""
    recipe = load_recipe(path, overrides)
    recipe_dir = Path(path).parent
    specs = check_teachers(recipe, path, recipe_dir)
    check_model(recipe, path)
    check_checkpoints(recipe, path)
    check_distill_routes(recipe, path)
    check_bench_suite(recipe, path, recipe_dir)
    check_curves(recipe, path, recipe_dir)
    check_precision_here(recipe, path)
    return recipe, specs


def fail(recipe_path: str | Path, field: str, problem: str) -> RecipeError:
    return RecipeError(f"{recipe_path}: field `{field}`: {problem}")


# ----------------------------------------------------------------------------- precision
def check_precision_here(recipe: Recipe, path: str | Path) -> None:
    """bf16 on a local run whose device lacks it is refused before any stage trains (the base and distill stages
    check again where they run: on a cluster, the workers' devices decide)."""
    from mopd.machine import resolve_device
    from mopd.precision import PrecisionError, check_precision

    if recipe.ray.address is not None:
        return
    stages = {"base.precision": recipe.base.precision if recipe.base.trains else None, "distill.precision": recipe.distill.precision}
    for field, precision in stages.items():
        try:
            check_precision(precision, resolve_device(recipe.device), field)
        except PrecisionError as err:
            raise fail(path, field, str(err).removeprefix(f"{field}: ")) from None


# ----------------------------------------------------------------------------- teachers
def check_teachers(recipe: Recipe, path: str | Path, recipe_dir: Path) -> dict[str, TeacherSpec]:
    spec_dir = resolve_path(recipe.teachers.spec_dir, recipe_dir)
    if not spec_dir.is_dir():
        raise fail(path, "teachers.spec_dir", f"{recipe.teachers.spec_dir}: no such directory")
    try:
        specs = load_teacher_specs(recipe, recipe_dir)
    except RecipeError as err:
        raise fail(path, "teachers.spec_dir", str(err)) from None
    for cell, spec in specs.items():
        if spec.init != "base":
            init = resolve_path(spec.init, None)
            check_checkpoint(path, f"teachers.{cell}.init", spec.init, init, recipe.max_model_len)
    return specs


# ----------------------------------------------------------------------------- model and checkpoints
def check_model(recipe: Recipe, path: str | Path) -> None:
    """The base stage builds its model from the preset; a bad preset would stop it after data generation,
    and the engines refuse a `max_model_len` beyond its positions."""
    if recipe.base.checkpoint is not None:
        return
    from mopd.model.config import preset_config

    try:
        config = preset_config(recipe.model.preset, **recipe.model.overrides)
    except KeyError as err:
        raise fail(path, "model.preset", err.args[0]) from None
    except (TypeError, ValueError) as err:
        raise fail(path, "model.overrides", str(err)) from None
    if config.max_position_embeddings < recipe.max_model_len:
        raise fail(path, "max_model_len", (
            f"max_model_len {recipe.max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings} (preset {recipe.model.preset!r}); raise model.overrides.max_position_embeddings"
        ))  # fmt: skip


def check_checkpoints(recipe: Recipe, path: str | Path) -> None:
    """Checkpoints the recipe names; paths as the stages open them (relative to the working directory)."""
    positions = recipe.max_model_len
    if recipe.base.checkpoint is not None:
        check_checkpoint(path, "base.checkpoint", recipe.base.checkpoint, Path(recipe.base.checkpoint), positions)
    if recipe.base.warmup:
        check_chat_format(path, "base.warmup", Path(recipe.base.checkpoint))
    if recipe.distill.student is not None:
        check_checkpoint(path, "distill.student", recipe.distill.student, Path(recipe.distill.student), positions)
    for cell, teacher in recipe.distill.teachers.items():
        check_checkpoint(path, f"distill.teachers.{cell}", teacher, Path(teacher), positions)


def check_chat_format(recipe_path: str | Path, field: str, directory: Path) -> None:
    """A checkpoint the run writes transcripts for: its tokenizer has our effort tokens or a chat template."""
    from transformers import AutoTokenizer

    from mopd.envs.chat import chat_format

    try:
        chat_format(AutoTokenizer.from_pretrained(directory))
    except (OSError, ValueError) as err:
        raise fail(recipe_path, field, f"{directory}: {err}") from None


def check_checkpoint(recipe_path: str | Path, field: str, given: str, directory: Path, max_model_len: int) -> None:
    """Any causal LM transformers can build from its config.json (no weights are read), with positions for
    `max_model_len` tokens."""
    if not directory.is_dir():
        raise fail(recipe_path, field, f"{given}: no such checkpoint directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise fail(recipe_path, field, f"{given}: not a checkpoint (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(recipe_path, field, f"{given}: config.json is unreadable ({err})") from None
    if not isinstance(config, dict):
        raise fail(recipe_path, field, f"{given}: config.json is not a JSON object")
    from mopd.model import CheckpointError, read_model_config

    try:
        model_config = read_model_config(directory)
    except CheckpointError as err:
        raise fail(recipe_path, field, f"{given}: {err}") from None
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is not None and positions < max_model_len:
        raise fail(recipe_path, field, (
            f"{given}: max_position_embeddings {positions} is below max_model_len {max_model_len}; "
            f"lower max_model_len or use a model with more positions"
        ))  # fmt: skip


# ----------------------------------------------------------------------------- distill
def check_distill_routes(recipe: Recipe, path: str | Path) -> None:
    """Each cell the student distils from needs a teacher: trained by the run, or named in distill.teachers."""
    trained = set(recipe.teachers.cells)
    for cell, weight in recipe.distill.mix.items():
        if weight > 0 and cell not in trained and cell not in recipe.distill.teachers:
            raise fail(
                path, f"distill.mix.{cell}",
                f"cell {cell} has no teacher: it is not in teachers.cells and distill.teachers names no checkpoint for it",
            )  # fmt: skip


# ----------------------------------------------------------------------------- bench
def check_bench_suite(recipe: Recipe, path: str | Path, recipe_dir: Path) -> None:
    """The suite as the bench stage loads it, its envs built with the recipe's options on top."""
    from mopd.bench.suite import close, load_suite, make_env

    suite_path = resolve_path(recipe.bench.suite, recipe_dir)
    try:
        suite = load_suite(suite_path)
        for domain in suite.domains:
            close(make_env(suite, domain, recipe.env_options(domain), source=recipe.bench.suite))
    except RecipeError as err:
        raise fail(path, "bench.suite", str(err)) from None
    for index, external in enumerate(recipe.bench.external):
        field = f"bench.external[{index}]"
        try:
            suite = load_suite(resolve_path(external, recipe_dir))
        except RecipeError as err:
            raise fail(path, field, str(err)) from None
        if not suite.external:
            raise fail(path, field, f"{external} is a {suite.split} suite; external suites declare `split: external`")


# ----------------------------------------------------------------------------- curves
def check_curves(recipe: Recipe, path: str | Path, recipe_dir: Path) -> None:
    """The learning curves' suite, as the curves stage opens it: it must be a dev suite."""
    if recipe.curves is None:
        return
    from mopd.bench.curves import check_curves_suite

    check_curves_suite(recipe, recipe_dir, where=f"{path}: field `curves.suite`")
