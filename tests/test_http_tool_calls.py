"""Tool calls: the parser on the text Qwen3's own chat template writes for a call, and a round trip through
both APIs on a tiny random Qwen3 model carrying that template (the tool definitions and results must reach
the prompt exactly as transformers renders them)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import register_model
from gguf_convert import write_gguf
from http_support import endpoint
from qwen3_template import qwen3_chat_template

from engine import GenerationResult
from engine.chat_template import ChatTemplate
from strata_mcp.http.tool_calls import ToolCallHold, parse_tool_calls, template_supports_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich", "units": ["c", "f"]})]


def transformers_render(messages, tools=None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=qwen3_chat_template(), add_generation_prompt=True
    )
    return rendered[0]


def template_tool_call_text(calls, content: str = "") -> str:
    """What the Qwen3 template writes for an assistant turn that makes these calls (the format the model
    learned to produce), cut out of a rendered conversation."""
    template = ChatTemplate(qwen3_chat_template(), {})
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    # A tool result after the call keeps the template from wrapping the turn in an empty <think> block.
    conversation = [{"role": "user", "content": "?"}, message, {"role": "tool", "content": "{}"}]
    text = template.render(conversation, add_generation_prompt=False)
    return text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]


def test_the_qwen3_template_takes_tools():
    assert template_supports_tools(qwen3_chat_template())
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_parser_reads_the_templates_own_tool_call_format(content):
    text = template_tool_call_text(CALLS, content)
    assert text.count("<tool_call>") == 2
    parsed_content, calls = parse_tool_calls(text)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in calls] == CALLS
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "No tools needed: the answer is 4.",
    "I would write <tool_call>{not json}</tool_call> here.",
    '<tool_call>\n["get_weather"]\n</tool_call>',
])
def test_text_that_is_no_call_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_stream_hold_sends_text_until_a_call_may_begin():
    hold = ToolCallHold()
    pieces = ["Sure. ", "<tool", "_call>\n{\"name\": ", "\"f\"}\n</tool_call>"]
    assert [hold.feed(p) for p in pieces] == ["Sure. ", "", "", ""]
    plain = ToolCallHold()
    assert plain.feed("a <to") == "a " and plain.feed("y") == "<toy" and plain.rest() == ""
    unfinished = ToolCallHold()
    assert unfinished.feed("x <tool") == "x " and unfinished.rest() == "<tool"


@pytest.fixture(scope="module")
def qwen3_endpoint(tmp_path_factory, smollm2_gguf):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("qwen3")
    gguf = write_gguf(tf.Qwen3ForCausalLM(config).eval(), "qwen3", folder / "tiny-qwen3.gguf", smollm2_gguf,
                      context_length=1024, chat_template=qwen3_chat_template())
    register_model(folder / "data", "tiny-qwen3", gguf)
    with endpoint(folder / "data", "tiny-qwen3") as (runtime, server):
        yield runtime, server


@pytest.fixture
def scripted(qwen3_endpoint, monkeypatch):
    """The model answers with the given text instead of its random one; the prompts it got are kept."""
    runtime, _ = qwen3_endpoint
    model = runtime.slot.model
    prompts: list[str] = []

    def answer_with(text: str):
        def generate(prompt, settings=None, on_text=None, should_stop=None):
            prompts.append(model.tokenizer.decode(prompt))
            for i in range(0, len(text), 5):
                on_text(text[i : i + 5])
            return GenerationResult(text, "stop", len(prompt), 0, len(model.tokenizer.encode(text)), 0.1, 0.1, 10.0, 10.0)

        monkeypatch.setattr(model, "generate", generate)

    return answer_with, prompts


def test_openai_tool_call_round_trip(qwen3_endpoint, scripted, monkeypatch):
    runtime, server = qwen3_endpoint
    answer_with, prompts = scripted
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="local", max_retries=0)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    answer_with(template_tool_call_text(CALLS[:1]))
    reply = client.chat.completions.create(model="tiny-qwen3", messages=question, tools=[WEATHER], max_tokens=32)
    assert prompts[-1] == transformers_render(question, [WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    answer_with(template_tool_call_text(CALLS[:1]))
    stream = client.chat.completions.create(model="tiny-qwen3", messages=question, tools=[WEATHER], max_tokens=32,
                                            stream=True)
    chunks = list(stream)
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [CALLS[0]]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    monkeypatch.undo()  # the engine itself answers the follow-up
    follow_up = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    reply = client.chat.completions.create(model="tiny-qwen3", messages=follow_up, tools=[WEATHER], max_tokens=4,
                                           temperature=0)
    expected = transformers_render(
        [*question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
         {"role": "tool", "content": '{"celsius": 21}'}], [WEATHER])
    assert "<tool_response>\n{\"celsius\": 21}\n</tool_response>" in expected
    assert reply.usage.prompt_tokens == len(runtime.slot.model.tokenizer.encode(expected))


def test_anthropic_tool_use_round_trip(qwen3_endpoint, scripted):
    runtime, server = qwen3_endpoint
    answer_with, prompts = scripted
    client = anthropic.Anthropic(base_url=server.base_url, api_key="local", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city now.",
            "input_schema": WEATHER["function"]["parameters"]}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    answer_with(template_tool_call_text(CALLS[:1], "Checking."))
    reply = client.messages.create(model="tiny-qwen3", max_tokens=32, system="Be brief.", messages=question,
                                   tools=[tool])
    assert prompts[-1] == transformers_render([{"role": "system", "content": "Be brief."}, *question], [WEATHER])
    assert reply.stop_reason == "tool_use"
    text, use = reply.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}

    answer_with(template_tool_call_text(CALLS[1:]))
    with client.messages.stream(model="tiny-qwen3", max_tokens=32, messages=question, tools=[tool]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == CALLS[1:]

    follow_up = [*question,
                 {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                   {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    answer_with("It is 21 C.")
    reply = client.messages.create(model="tiny-qwen3", max_tokens=32, messages=follow_up, tools=[tool])
    assert reply.content[0].text == "It is 21 C." and reply.stop_reason == "end_turn"
    assert prompts[-1] == transformers_render(
        [*question,
         {"role": "assistant", "content": "Checking.",
          "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "21 C"}], [WEATHER])
