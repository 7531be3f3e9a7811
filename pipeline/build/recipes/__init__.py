"""Candidate recipes: one per kind of [[candidates]] row, registered in one table (as Olive registers passes).

    kind (engine, quantize)      recipe                 families          precisions
    onnxruntime, none            ort-fp32               encoder, decoder  fp32     (and speech, text2text*)
    onnxruntime, dynamic         ort-int8-dynamic       encoder           int8     (and speech, text2text*)
    onnxruntime, static          ort-int8-static        encoder           int8
    openvino, none               openvino               encoder           fp32, bf16
    openvino, nncf               openvino-int8          encoder           int8
    openvino, dynamic            openvino-int8-dynamic  encoder           int8
    onnxruntime, weight_only     weight-only            decoder           int8, int4  (and speech, text2text*)

* A speech or text-to-text model's two graphs are made by pipeline/build/search/encoder_decoder.py, of these three
  kinds only.

The searches look each candidate's recipe up here (`recipe_for`) and never branch on kind names; a target whose
candidate has no recipe, or asks one for a family or precision it does not build, is refused when parsed
(`checked_target`, which the build and `pipeline check` load targets with).
"""

from __future__ import annotations

from pipeline.build.recipes.base import ROW_COLUMNS, Built, Job, Recipe
from pipeline.build.recipes.openvino import OpenVino
from pipeline.build.recipes.openvino_dynamic import OpenVinoDynamic
from pipeline.build.recipes.openvino_int8 import OpenVinoInt8
from pipeline.build.recipes.ort_fp32 import OrtFp32
from pipeline.build.recipes.ort_int8 import OrtInt8
from pipeline.build.recipes.weight_only import WeightOnly
from pipeline.errors import TargetError

__all__ = [
    "RECIPES",
    "ROW_COLUMNS",
    "Built",
    "Job",
    "Recipe",
    "build_candidate",
    "check_candidates",
    "checked_target",
    "recipe_for",
    "registry",
]


def registry(*recipes: Recipe) -> dict[tuple[str, str], Recipe]:
    """The table kind -> recipe; two recipes of one kind, or of one name, are an error."""
    table: dict[tuple[str, str], Recipe] = {}
    for recipe in recipes:
        if recipe.kind in table or recipe.name in {r.name for r in table.values()}:
            raise ValueError(f"recipe {recipe.name} ({', '.join(recipe.kind)}) is registered twice")
        table[recipe.kind] = recipe
    return table


RECIPES = registry(
    OrtFp32(), OrtInt8("dynamic"), OrtInt8("static"), OpenVino(), OpenVinoInt8(), OpenVinoDynamic(), WeightOnly()
)


def _kinds() -> str:
    return ", ".join(f"{r.name} (engine = {r.engine!r}, quantize = {r.quantize!r})" for r in RECIPES.values())


def recipe_for(candidate) -> Recipe:
    """The recipe that builds `candidate` (a parsed [[candidates]] row), by its engine and quantize."""
    recipe = RECIPES.get((candidate.engine, candidate.quantize))
    if recipe is None:
        raise TargetError(
            f"candidate {candidate.name!r}: no recipe builds engine = {candidate.engine!r} with quantize = "
            f"{candidate.quantize!r}; available: {_kinds()}. Set engine and quantize to one of those."
        )
    return recipe


def build_candidate(candidate, job: Job) -> Built:
    """Build `candidate` on `job.target` into `job.work` with its recipe."""
    recipe = recipe_for(candidate)
    return recipe.build(recipe.config(candidate, job.target), job)


def check_candidates(where, candidates) -> None:
    """Refuse (TargetError naming `where`) a candidate without a recipe, or whose recipe does not build its family
    or precision."""
    for candidate in candidates:
        try:
            recipe = recipe_for(candidate)
        except TargetError as err:
            raise TargetError(f"{where}: {err}") from None
        for key, value, allowed in (
            ("family", candidate.family, recipe.families),
            ("precision", candidate.precision, recipe.precisions),
        ):
            if value not in allowed:
                raise TargetError(
                    f"{where}: candidate {candidate.name!r}: recipe {recipe.name} builds {key} "
                    f"{', '.join(allowed)}, not {value!r}; set {key} to one of those, or another engine or quantize."
                )


def checked_target(name_or_path: str, targets_dir=None):
    """`load_target`, then `check_candidates`: a target whose candidates no recipe builds is refused before any
    stage. (The check lives here, not in targets.py, which the recipes import.)"""
    from pathlib import Path

    from pipeline.build.inputs.targets import TARGETS_DIR, load_target

    target = load_target(name_or_path, Path(targets_dir) if targets_dir else TARGETS_DIR)
    source = Path(name_or_path) if str(name_or_path).endswith(".toml") else target.name
    check_candidates(source, target.candidates)
    return target
