"""choose_model: the best model that fits this PC for what the person wants."""

from __future__ import annotations

from typing import Literal

from mcp.types import ToolAnnotations
from pydantic import Field

from setup_logic.catalog import load_catalog
from setup_logic.choice import Recommendation, recommend
from setup_logic.engine_profile import KvCacheType
from setup_logic.fit import Preferences
from setup_logic.hardware import probe
from strata_mcp.runtime import Runtime, engine_profile
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec

GIB = 1024**3


class ChooseModelInput(ToolInput):
    goal: Literal["code", "chat", "speed", "quality"] = Field(
        "chat", description="What matters most: code, chat, speed (tokens/s) or quality."
    )
    context_length: int | None = Field(
        None, ge=512, le=1_048_576, description="Tokens of context wanted; default: the most that fits, up to 8192."
    )
    ram_gb: float | None = Field(None, gt=0, le=4096, description="Override the detected RAM (GiB) when detection is wrong.")
    vram_gb: float | None = Field(
        None, ge=0, le=1024, description="Override the detected free VRAM (GiB) when detection is wrong; 0 means no GPU."
    )
    kv_cache: KvCacheType = Field(
        "full", description="The KV cache type start will use: q8_0 halves the GPU's KV-cache memory, so a longer "
        "context fits (logits change slightly)."
    )


def run(runtime: Runtime, args: ChooseModelInput, reporter: Reporter) -> Recommendation:
    prefs = Preferences(
        goal=args.goal,
        context_length=args.context_length,
        ram_bytes_override=None if args.ram_gb is None else int(args.ram_gb * GIB),
        vram_bytes_override=None if args.vram_gb is None else int(args.vram_gb * GIB),
        kv_cache=args.kv_cache,
    )
    installed = {m.id for m in runtime.store.installed()}
    return recommend(probe(runtime.store.data_dir, engine_profile()), load_catalog(), prefs, engine_profile(), installed)


SPEC = ToolSpec(
    name="choose_model",
    title="Choose a model",
    description=(
        "Pick the best model for this PC and goal (code, chat, speed, quality): the context length, where "
        "the memory goes (weights, KV cache, overhead; GPU or RAM), with experts in RAM the most tokens/s this "
        "PC's RAM allows, why it was picked, the runners-up that fit, the models that do not fit and why, and "
        "those our engine cannot run yet. Pass ram_gb/vram_gb to override wrong detection. Next: install with the "
        "chosen model id."
    ),
    input_model=ChooseModelInput,
    output_model=Recommendation,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, openWorldHint=False),
)
