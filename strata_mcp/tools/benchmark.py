"""benchmark: prompt and output speed of the loaded model on a fixed prompt, with the machine named."""

from __future__ import annotations

import itertools
import time

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from engine import GenerationSettings
from setup_logic.hardware import probe_cpu, probe_nvidia
from strata_mcp.runtime import Runtime
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec

# Plain prose of about 300 tokens, the same on every run, so runs compare; the run number in front makes
# each prompt new to the KV cache, so its prefill is measured rather than reused.
PROMPT = (
    "Below is the start of a report written by a harbour office about one ordinary working week.\n\n"
    "On Monday the morning fog lay low over the water until nine, and the ferry to the island left forty "
    "minutes late. Two fishing boats came back early with torn nets; the crews spent the afternoon mending "
    "them on the quay while the gulls waited on the railings. The harbour master walked the length of the "
    "north pier to check the lamps, found one cracked lens, and ordered a new one from the workshop in town. "
    "On Tuesday a cargo ship unloaded timber and sacks of grain, and the cranes worked until after dark. A "
    "child lost a red kite over the breakwater, and a sailor on the cargo ship caught it from the deck and "
    "brought it back down the gangway. On Wednesday the wind turned to the east and grew strong by noon; the "
    "small boats stayed in, the ferry crossed twice instead of four times, and the café by the fish market "
    "sold more soup than it had all month. The school brought two classes to see the lifeboat, and the crew "
    "showed them the engine, the radio and the heavy orange suits. On Thursday the weather cleared, the "
    "painters began on the old customs house, and a yacht from the south arrived with a broken mast. The "
    "owners stayed in the guest house and told everyone in the bar how the storm had found them off the cape. "
    "On Friday morning the new lens for the lamp arrived, and"
)


class BenchmarkInput(ToolInput):
    max_tokens: int = Field(128, ge=16, le=1024, description="Tokens to generate (the model does not stop early).")


class BenchmarkOutput(BaseModel):
    summary: str
    model: str
    machine: str = Field(description="What the model ran on: the GPU's name, or the CPU's model.")
    backend: str
    prompt_tokens: int = Field(description="Prompt tokens processed (not reused from the KV cache).")
    prompt_tokens_per_second: float
    output_tokens: int
    output_tokens_per_second: float
    wall_seconds: float
    note: str = "Speed depends on the context in use, other load on the machine and, on a GPU, its clocks and free memory."


def machine_name(backend: str) -> str:
    if backend == "cupy":
        gpus, _ = probe_nvidia()
        if gpus:
            return max(gpus, key=lambda g: g.vram_free_bytes).name  # the GPU the engine picks
    return probe_cpu().model


_RUN_NUMBERS = itertools.count(1)


def run(runtime: Runtime, args: BenchmarkInput, reporter: Reporter) -> BenchmarkOutput:
    settings = GenerationSettings(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    with runtime.chatting() as (model, cancel_event):
        produced = {"pieces": 0}

        def on_text(text: str) -> None:
            produced["pieces"] += 1
            reporter.progress(produced["pieces"], args.max_tokens, "generating")

        result = model.complete(
            f"Run {next(_RUN_NUMBERS)}. {PROMPT}", settings, on_text=on_text,
            should_stop=lambda: cancel_event.is_set() or reporter.cancelled(),
        )
        backend = model.info.backend
    wall = time.perf_counter() - started
    model_id = runtime.slot.model_id or ""
    machine = machine_name(backend)
    processed = result.prompt_tokens - result.cached_prompt_tokens
    summary = (f"{model_id} on {machine}: {result.completion_tokens} tokens at {result.output_tokens_per_second:.1f} "
               f"tokens/s (prompt {processed} tokens at {result.prompt_tokens_per_second:.0f} tokens/s), "
               f"{wall:.1f} s in total.")
    runtime.log.info("benchmark: %s", summary)
    return BenchmarkOutput(
        summary=summary, model=model_id, machine=machine, backend=backend, prompt_tokens=processed,
        prompt_tokens_per_second=result.prompt_tokens_per_second, output_tokens=result.completion_tokens,
        output_tokens_per_second=result.output_tokens_per_second, wall_seconds=wall,
    )


SPEC = ToolSpec(
    name="benchmark",
    title="Measure the model's speed",
    description=(
        "Prompt processing and output speed (tokens/s) of the loaded model on a fixed prompt of about 300 "
        "tokens, greedy, generating max_tokens tokens, with the GPU or CPU it ran on named. Needs a started, "
        "idle model (refused while it answers a chat)."
    ),
    input_model=BenchmarkInput,
    output_model=BenchmarkOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=False, openWorldHint=False),
)
