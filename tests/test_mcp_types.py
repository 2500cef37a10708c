"""One type per concept: sampling defaults in GenerationSettings only, timings derived from the engine's result."""

from __future__ import annotations

import dataclasses

import pytest

from engine import GenerationResult, GenerationSettings
from engine.backend import SamplingParams
from strata_mcp.cli import build_parser, given
from strata_mcp.reports import ChatTimings
from strata_mcp.tooling import parse_args
from strata_mcp.tools import chat


def test_the_tool_and_the_cli_sample_with_the_engine_defaults():
    engine_defaults = dataclasses.replace(GenerationSettings(), stop=[])
    from_the_tool = parse_args(chat.SPEC, {"prompt": "hi"}).settings()
    from_the_cli = parse_args(chat.SPEC, given(build_parser().parse_args(["chat", "hi"]), chat.SPEC)).settings()
    assert from_the_tool == from_the_cli == engine_defaults


def test_sampling_params_have_no_defaults_of_their_own():
    with pytest.raises(TypeError):
        SamplingParams()  # type: ignore[call-arg]
    assert GenerationSettings(top_k=3).sampling().top_k == 3


def test_chat_timings_carry_every_figure_of_the_result():
    result = GenerationResult("text", "stop", 10, 4, 6, 0.5, 1.5, 12.0, 4.0)
    figures = dataclasses.asdict(result)
    del figures["text"], figures["finish_reason"]
    assert ChatTimings.model_validate(result).model_dump() == figures
