"""start: load an installed model into the engine (in the background)."""

from __future__ import annotations

from typing import Literal

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from setup_logic.catalog import get_model
from setup_logic.engine_profile import KvCacheType
from setup_logic.errors import UnknownModelError
from setup_logic.fit import Preferences, fit_model
from setup_logic.hardware import GIB, probe
from strata_mcp.http.serving import serve
from strata_mcp.reports import EngineStatus, engine_status
from strata_mcp.runtime import Runtime, UserError, engine_profile
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class StartInput(ToolInput):
    model: str | None = Field(None, description="Installed model id; default: the only installed model (with several installed, give one).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: the GPU when an NVIDIA GPU with CUDA and CuPy is usable, else the CPU."
    )
    context_length: int | None = Field(
        None, ge=256, le=1_048_576,
        description="Tokens of context; default: the context choose_model picks for this model on this PC.",
    )
    vram_gb: float | None = Field(
        None, gt=0, le=4096,
        description="GPU memory the model may use, in GB; default: the GPU's free memory. A mixture of experts that "
        "does not fit keeps the experts of some layers in RAM, where the CPU computes most of them (choose_model's "
        "fit picks how many).",
    )
    kv_cache: KvCacheType = Field(
        "full", description="The KV cache's type: full, or q8_0, which halves the GPU's KV-cache memory so a longer "
        "context fits (ask for it with context_length); logits change slightly."
    )
    wait_seconds: float = Field(120.0, ge=0, le=3600, description="How long to wait for the load (reporting progress) before returning 'loading'.")
    serve: bool = Field(
        False, description="Also serve the model to other apps: an OpenAI- and Anthropic-compatible endpoint on "
        "127.0.0.1 (connect_info says how apps connect)."
    )
    port: int | None = Field(None, ge=1, le=65535, description="The endpoint's port; default: the one used last time, else a free one.")


class StartOutput(BaseModel):
    summary: str
    engine: EngineStatus
    endpoint: str | None = Field(None, description="The HTTP endpoint's base URL while it serves.")


def _pick_model(runtime: Runtime, requested: str | None) -> str:
    if requested is not None:
        return requested
    installed = [m.id for m in runtime.store.installed()]
    if len(installed) == 1:
        return installed[0]
    if not installed:
        raise UserError("No model is installed yet; call install (confirm=true) first.")
    raise UserError(f"Several models are installed ({', '.join(installed)}); pass model to say which to start.")


def _fitted(runtime: Runtime, model_id: str, args: StartInput) -> tuple[str, int | None, int, int, int | None]:
    """The device, context, experts placement (layers in RAM, cache slots) and prompt chunk choose_model's fit picks
    for this model on this PC (within vram_gb when given), so the two agree; the engine's defaults for a model the
    catalog does not know."""
    try:
        model = get_model(model_id)
    except UnknownModelError:  # installed from a catalog that is no longer configured
        return args.device, args.context_length, 0, 0, None
    vram = 0 if args.device == "cpu" else None if args.vram_gb is None else round(args.vram_gb * GIB)
    prefs = Preferences(context_length=args.context_length, vram_bytes_override=vram, kv_cache=args.kv_cache)
    fit = fit_model(model, probe(runtime.store.data_dir, engine_profile()), prefs, engine_profile())
    if fit.level == "none" and args.vram_gb is not None:
        raise UserError(f"{model_id} does not fit in {args.vram_gb:g} GB of GPU memory on this PC: {fit.reason}")
    device = "cpu" if fit.level == "cpu" and args.device == "auto" and args.vram_gb is not None else args.device
    split = fit.level == "gpu+ram" and fit.memory is not None
    layers, slots = (fit.memory.expert_layers_in_ram, fit.memory.expert_cache_slots) if split else (0, 0)
    chunk = fit.memory.prompt_chunk if fit.memory is not None and fit.level != "cpu" and device != "cpu" else None
    return device, args.context_length or fit.context_length, layers or 0, slots, chunk


def run(runtime: Runtime, args: StartInput, reporter: Reporter) -> StartOutput:
    model_id = _pick_model(runtime, args.model)
    device, context, layers_in_ram, cache_slots, chunk = _fitted(runtime, model_id, args)
    runtime.start_model(model_id, device, context, layers_in_ram, cache_slots, args.kv_cache, chunk)
    slot = runtime.wait_until_loaded(args.wait_seconds, reporter.cancelled, reporter.progress)
    status = engine_status(slot, runtime.memory_estimate(slot))
    if slot.state in ("ready", "busy"):
        summary = (
            f"{model_id} is ready on {status.backend} ({status.backend_reason}), context {status.context_length} tokens"
            f"{' in a q8_0 KV cache' if status.kv_cache_type == 'q8_0' else ''}, loaded in {slot.load_seconds:.1f} s; "
            "next: chat."
        )
        if status.expert_layers_in_ram:
            summary += (f" The experts of {status.expert_layers_in_ram} layers are in RAM, computed by the CPU "
                        "(a few of each token's read by the GPU over the bus)")
            cache = status.expert_cache
            summary += (f"; the GPU holds the {cache.slots_per_layer} most picked of each such layer as well."
                        if cache is not None and cache.slots_per_layer else ".")
    elif slot.state == "loading":
        where = f" ({slot.load.message})" if slot.load.message else ""
        summary = f"{model_id} is still loading{where}; call status or start again to follow it."
    else:
        summary = f"{model_id} did not load: {slot.error}"
    endpoint = None
    if args.serve and slot.state != "failed":
        endpoint = serve(runtime, port=args.port).base_url
        summary += f" Serving at {endpoint}/v1 (OpenAI) and {endpoint} (Anthropic); connect_info has app settings."
    return StartOutput(summary=summary, engine=status, endpoint=endpoint)


SPEC = ToolSpec(
    name="start",
    title="Start (load) a model",
    description=(
        "Load an installed model into the in-process engine (GPU when available, else CPU) and wait up to "
        "wait_seconds, reporting progress; returns 'ready' or 'loading' (call start again to follow a load). "
        "model may be left out only when exactly one model is installed. One model is loaded at a time: stop the "
        "current one first to switch. Says which backend was chosen and why. A mixture of experts that does not fit "
        "the GPU (or vram_gb) keeps the experts of some layers in RAM, computed by the CPU, and fills the VRAM left with "
        "the experts those layers pick most: the engine status says how many (expert_layers_in_ram, expert_cache). "
        "Long prompts run in chunks of up to 2,048 tokens on the GPU, fewer where the fit found memory tight "
        "(engine.prompt_chunk)."
    ),
    input_model=StartInput,
    output_model=StartOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=False),
)
