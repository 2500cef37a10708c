"""Which model to pick for this PC and goal: every catalog model the engine can run, fitted (fit.py), ranked by the
goal, with the runners-up, those that do not fit and those the engine cannot run yet, each with why."""

from __future__ import annotations

from pydantic import BaseModel, Field

from setup_logic.catalog import CatalogModel
from setup_logic.engine_profile import EngineProfile
from setup_logic.fit import (FitResult, Goal, Level, MemoryEstimate, Preferences, budget_for, bytes_read_per_token,
                             fit_within)
from setup_logic.hardware import PcReport, gb

# Tiny demo models answer fast but poorly; "speed" picks them only when nothing better fits.
_MIN_USEFUL_QUALITY = 3.0


class ModelChoice(BaseModel):
    model_id: str
    name: str
    quant: str
    why: str
    level: Level
    context_length: int
    largest_context_that_fits: int
    memory: MemoryEstimate
    download_bytes: int
    bytes_read_per_token: int = Field(description="weights read per generated token, the speed proxy")
    tokens_per_s_bound: float | None = Field(
        description="an upper bound on decode speed with experts in RAM, from the measured RAM bandwidth (gpu+ram)"
    )
    quality: float
    good_for: list[str]
    installed: bool


class RejectedModel(BaseModel):
    id: str
    name: str
    reason: str


class Recommendation(BaseModel):
    summary: str
    goal: Goal
    vram_budget_bytes: int = Field(description="VRAM a model may use: free VRAM of the best GPU, or the override")
    ram_budget_bytes: int = Field(description="RAM a model may use: available RAM, or the override")
    choice: ModelChoice | None
    alternatives: list[ModelChoice] = Field(description="other models that fit, best first")
    not_fitting: list[RejectedModel]
    not_supported: list[RejectedModel] = Field(description="models the engine cannot run yet, with what is missing")


def _unsupported_reason(model: CatalogModel, engine: EngineProfile) -> str | None:
    missing = []
    if model.architecture not in engine.supported_architectures:
        missing.append(f"the {model.architecture} architecture")
    types = sorted(set(model.tensor_types) - engine.supported_tensor_types)
    if types:
        missing.append(("tensor types " if len(types) > 1 else "the tensor type ") + ", ".join(types))
    if not missing:
        return None
    return f"Needs {' and '.join(missing)}, which the engine does not run yet."


def _rank_key(model: CatalogModel, fit: FitResult, goal: Goal, installed: bool):
    # GPU levels first: a model on the CPU is several times slower, whatever else it offers.
    tier = 1 if fit.level == "cpu" else 0
    speed = bytes_read_per_token(model)
    if goal == "speed":
        key = (model.quality < _MIN_USEFUL_QUALITY, speed, -model.quality)
    elif goal == "quality":
        key = (-model.quality, speed)
    else:
        # At equal quality a model made for this goal alone beats an all-rounder.
        key = (goal not in model.good_for, -model.quality, len(model.good_for), speed)
    return (tier, *key, not installed, model.id)


def _goal_phrase(model: CatalogModel, goal: Goal) -> str:
    if goal == "speed":
        return f"the fastest useful model that fits ({gb(bytes_read_per_token(model))} of weights read per token)"
    if goal == "quality":
        return "the highest-quality model that fits"
    if goal in model.good_for:
        return f"the best model for {goal} that fits"
    return f"no model made for {goal} fits, so the best other model"


def _level_words(level: Level) -> str:
    return {"gpu": "on the GPU", "gpu+ram": "on the GPU with experts in RAM", "cpu": "on the CPU"}[level]


def recommend(
    report: PcReport,
    models: list[CatalogModel],
    prefs: Preferences,
    engine: EngineProfile,
    installed_ids: set[str] | frozenset[str] = frozenset(),
) -> Recommendation:
    """Pick the model for this PC and goal, with the runners-up, those that do not fit and those not supported."""
    budget = budget_for(report, prefs, engine)
    fitting: list[tuple[CatalogModel, FitResult]] = []
    not_fitting: list[RejectedModel] = []
    not_supported: list[RejectedModel] = []
    for model in models:
        missing = _unsupported_reason(model, engine)
        if missing:
            not_supported.append(RejectedModel(id=model.id, name=model.name, reason=missing))
            continue
        fit = fit_within(model, budget, prefs, engine)
        if fit.level == "none":
            not_fitting.append(RejectedModel(id=model.id, name=model.name, reason=fit.reason))
        else:
            fitting.append((model, fit))
    fitting.sort(key=lambda pair: _rank_key(pair[0], pair[1], prefs.goal, pair[0].id in installed_ids))
    choices = [
        ModelChoice(
            model_id=model.id,
            name=model.name,
            quant=model.quant,
            why=fit.reason,
            level=fit.level,
            context_length=fit.context_length,
            largest_context_that_fits=fit.largest_context_that_fits,
            memory=fit.memory,
            download_bytes=model.file_bytes,
            bytes_read_per_token=bytes_read_per_token(model),
            tokens_per_s_bound=fit.tokens_per_s_bound,
            quality=model.quality,
            good_for=list(model.good_for),
            installed=model.id in installed_ids,
        )
        for model, fit in fitting
    ]
    if choices:
        best, model = choices[0], fitting[0][0]
        best.why = f"{best.why[:-1]}; {_goal_phrase(model, prefs.goal)}."
        bound = "" if best.tokens_per_s_bound is None else f" (up to about {best.tokens_per_s_bound:.1f} tokens/s)"
        summary = (
            f"{best.name} ({best.quant}) {_level_words(best.level)} with {best.context_length} tokens of "
            f"context{bound}: {_goal_phrase(model, prefs.goal)}."
        )
    elif not_fitting:
        summary = "No supported model in the catalog fits this PC; see not_fitting for what each one needs."
    else:
        summary = "The engine cannot run any model in the catalog yet; see not_supported for what is missing."
    return Recommendation(
        summary=summary,
        goal=prefs.goal,
        vram_budget_bytes=budget.vram,
        ram_budget_bytes=budget.ram,
        choice=choices[0] if choices else None,
        alternatives=choices[1:],
        not_fitting=not_fitting,
        not_supported=not_supported,
    )
