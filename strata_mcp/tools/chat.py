"""chat: answer with the loaded model."""

from __future__ import annotations

import dataclasses
from typing import Literal

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field, model_validator

from engine import DamagedModel, GenerationSettings
from strata_mcp.reports import ChatTimings
from strata_mcp.runtime import Runtime, UserError
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


# The defaults are GenerationSettings' own; the fields it shares with the input become the settings.
DEFAULTS = GenerationSettings()
SETTING_NAMES = {f.name for f in dataclasses.fields(GenerationSettings)}


class ChatMessage(ToolInput):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatInput(ToolInput):
    messages: list[ChatMessage] | None = Field(
        None, description="The conversation so far, oldest first, ending with the user's turn. Give this or prompt."
    )
    prompt: str | None = Field(None, description="A single user message (shorthand for messages=[{role: user, content: prompt}]).")
    max_tokens: int = Field(DEFAULTS.max_tokens, ge=1, le=32768, description="Most tokens to generate.")
    temperature: float = Field(DEFAULTS.temperature, ge=0, le=5, description="0 = greedy (deterministic).")
    top_k: int = Field(DEFAULTS.top_k, ge=0, le=100000, description="Keep the k most likely tokens (0 = off).")
    top_p: float = Field(DEFAULTS.top_p, gt=0, le=1, description="Nucleus sampling threshold (1 = off).")
    min_p: float = Field(
        DEFAULTS.min_p, ge=0, le=1, description="Drop tokens less likely than min_p x the top token (0 = off)."
    )
    repeat_penalty: float = Field(
        DEFAULTS.repeat_penalty, ge=0.5, le=3, description="Penalty for tokens already in the text (1 = off)."
    )
    seed: int | None = Field(DEFAULTS.seed, ge=0, description="Fixes the sampling for a reproducible answer.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop when any of these strings appears.")
    raw: bool = Field(
        False, description="With prompt: continue the text as it is, without the chat template (for base models that have none)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ChatInput:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either messages or prompt, not both and not neither")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty; include at least the user's message")
        if self.raw and self.prompt is None:
            raise ValueError("raw continues a prompt; give prompt instead of messages")
        return self

    def conversation(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def settings(self) -> GenerationSettings:
        return GenerationSettings(**self.model_dump(include=SETTING_NAMES))


class ChatOutput(BaseModel):
    summary: str
    text: str = Field(description="The model's answer.")
    finish_reason: Literal["stop", "length", "cancelled"]
    model: str
    timings: ChatTimings


def run(runtime: Runtime, args: ChatInput, reporter: Reporter) -> ChatOutput:
    with runtime.chatting() as (model, cancel_event):
        streamed = {"pieces": 0, "tail": ""}

        def on_text(text: str) -> None:
            # Only the last 200 characters travel with a progress update; keep just those, not the whole answer.
            streamed["pieces"] += 1
            streamed["tail"] = (streamed["tail"] + text)[-200:]
            reporter.progress(streamed["pieces"], args.max_tokens, streamed["tail"])

        if not args.raw and not model.info.has_chat_template:
            raise UserError(
                f"{runtime.slot.model_id} is a base model with no chat template; call chat with prompt and raw=true "
                "to have it continue the text."
            )
        should_stop = lambda: cancel_event.is_set() or reporter.cancelled()  # noqa: E731
        try:
            if args.raw:
                result = model.complete(args.prompt or "", args.settings(), on_text=on_text, should_stop=should_stop)
            else:
                result = model.chat(args.conversation(), args.settings(), on_text=on_text, should_stop=should_stop)
        except DamagedModel:
            model_id = runtime.slot.model_id
            raise UserError(f"{model_id} computed invalid numbers (NaN or infinity), so its file is damaged: call stop, "
                            f"then install model={model_id} verify=true, which checks every byte and downloads a "
                            "damaged file again.") from None
    runtime.record_chat(model, result)
    summary = (
        f"{result.completion_tokens} tokens ({result.finish_reason}) at {result.output_tokens_per_second:.1f} tokens/s; "
        f"prompt {result.prompt_tokens} tokens at {result.prompt_tokens_per_second:.0f} tokens/s."
    )
    return ChatOutput(summary=summary, text=result.text, finish_reason=result.finish_reason,
                      model=runtime.slot.model_id or "", timings=ChatTimings.model_validate(result))


SPEC = ToolSpec(
    name="chat",
    title="Chat with the local model",
    description=(
        "Answer with the loaded model: pass messages (multi-turn; the KV cache of the shared prefix is reused, "
        "so follow-ups are fast) or a single prompt, plus sampling settings (temperature 0 = greedy). Returns "
        "the text, why it stopped, token counts and speeds. Needs a started model; one chat runs at a time "
        "(a second concurrent chat is refused, not queued). Cancelling the request stops generation cleanly."
    ),
    input_model=ChatInput,
    output_model=ChatOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=False),
)
