"""The OpenAI- and Anthropic-compatible endpoint on the embedded model, through the official `openai` and
`anthropic` clients (and plain httpx where a client would refuse to send a bad request)."""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import httpx2 as httpx
import openai
import pytest
from conftest import register_model
from http_support import endpoint

from strata_mcp.runtime import UserError
from strata_mcp.server_log import log_path, tail

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf):
    data = tmp_path_factory.mktemp("http") / "data"
    register_model(data, MODEL, smollm2_gguf)
    with endpoint(data, MODEL, context_length=256) as (runtime, server):
        yield runtime, server


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=f"{served[1].base_url}/v1", api_key="local", max_retries=0)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served[1].base_url, api_key="local", max_retries=0)


def rendered_tokens(runtime, messages) -> int:
    model = runtime.slot.model
    return len(model.tokenizer.encode(model.render_chat(messages)))


def test_models_lists_the_loaded_model(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_openai_chat_stream_equals_plain_and_counts_usage(served, oai):
    runtime, _ = served
    plain = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, **GREEDY)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == rendered_tokens(runtime, QUESTION)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12

    chunks = list(oai.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=12, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 12)
    # The same conversation again: its prompt is reused from the KV cache but the last token.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_openai_stop_sequence_cuts_the_answer(oai):
    full = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, **GREEDY).choices[0].message.content
    stop = full.split()[2]
    cut = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, stop=[stop, "never seen"], **GREEDY)
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_raw_completion(oai):
    plain = oai.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, **GREEDY)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 6
    streamed = oai.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    sampled = [oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7)
               for _ in range(2)]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text  # the seed fixes the sampling


def test_anthropic_message_stream_and_usage(served, claude):
    runtime, server = served
    greedy = {"extra_body": GREEDY}
    plain = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=QUESTION, **greedy)
    (block,) = plain.content
    assert block.type == "text" and block.text and plain.stop_reason == "max_tokens"
    prompt = rendered_tokens(runtime, [{"role": "system", "content": "Be brief."}, *QUESTION])
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (prompt, 12)
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=QUESTION)
    assert counted.input_tokens == prompt

    with claude.messages.stream(model=MODEL, max_tokens=12, system="Be brief.", messages=QUESTION, **greedy) as stream:
        assert "".join(stream.text_stream) == block.text
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12

    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, timeout=120) as response:
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequence_is_named(claude):
    greedy = {"extra_body": GREEDY}
    full = claude.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, **greedy).content[0].text
    stop = full.split()[2]
    cut = claude.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, stop_sequences=[stop], **greedy)
    assert cut.content[0].text == full[: full.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def post(server, path: str, body, headers=None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, None),
    ({"model": MODEL, "messages": "hello"}, 400, None),
    ({"model": MODEL}, 400, None),
    ({"model": "gpt-9", "messages": QUESTION}, 404, "model_not_found"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "context_length_exceeded"),
])
def test_openai_errors_have_openai_shape(served, body, status, code):
    response = post(served[1], "/v1/chat/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert error["message"].endswith(".") and "Traceback" not in error["message"]


def test_openai_client_raises_on_its_errors(oai):
    with pytest.raises(openai.NotFoundError, match="is not loaded here"):
        oai.chat.completions.create(model="gpt-9", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="context holds only 256"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 400}])


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"model": MODEL, "max_tokens": "many", "messages": QUESTION}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": QUESTION}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error"),
    ({"model": "claude-opus-9", "max_tokens": 8, "messages": QUESTION}, 404, "not_found_error"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "invalid_request_error"),
])
def test_anthropic_errors_have_anthropic_shape(served, body, status, kind):
    response = post(served[1], "/v1/messages", body)
    assert response.status_code == status
    reply = response.json()
    assert reply["type"] == "error" and reply["error"]["type"] == kind and reply["error"]["message"]


def test_tools_on_a_template_without_them_are_refused(served):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    reply = post(served[1], "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [weather]})
    assert reply.status_code == 400 and "no place for tools" in reply.json()["error"]["message"]
    # A tool without input_schema (as Claude Code sends its server tools) passes validation to the same refusal.
    reply = post(served[1], "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION,
                                             "tools": [{"name": "web_search", "type": "web_search_20250305"}]})
    assert reply.status_code == 400 and "no place for tools" in reply.json()["error"]["message"]


def test_invalid_json_is_a_clean_400(served):
    response = httpx.post(f"{served[1].base_url}/v1/chat/completions", content=b"{nope", timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_no_model_loaded_is_503_in_both_shapes(tmp_path):
    with endpoint(tmp_path / "data", None) as (_, server):
        openai_reply = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION})
        anthropic_reply = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION})
        assert [r.status_code for r in (openai_reply, anthropic_reply)] == [503, 503]
        assert openai_reply.json()["error"]["code"] == "model_not_loaded"
        assert anthropic_reply.json()["type"] == "error"
        assert post(server, "/v1/models", None).status_code == 405
        assert httpx.get(f"{server.base_url}/v1/models").json()["data"] == []


def test_beyond_localhost_needs_a_key_on_every_request(tmp_path):
    with pytest.raises(UserError, match="API key"):
        with endpoint(tmp_path / "data", None, host="0.0.0.0"):
            pass
    with endpoint(tmp_path / "data", None, host="0.0.0.0", api_key="s3cret") as (_, server):
        url = f"http://127.0.0.1:{server.port}"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "s3cre"}):
            refused = httpx.get(f"{url}/v1/models", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        refused = httpx.post(f"{url}/v1/messages", json={}, headers={"x-api-key": "nope"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_the_port_is_remembered(tmp_path):
    with endpoint(tmp_path / "data", None) as (_, first):
        port = first.port
    with endpoint(tmp_path / "data", None) as (_, second):
        assert second.port == port


def test_two_clients_at_once_are_both_answered_in_turn(served, oai):
    runtime, _ = served
    replies: dict[int, object] = {}

    def ask(n: int) -> None:
        replies[n] = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {n}."}],
                                                 max_tokens=6, **GREEDY)

    threads = [threading.Thread(target=ask, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(replies) == [1, 2]
    assert all(r.choices[0].message.content and r.usage.completion_tokens == 6 for r in replies.values())
    assert runtime.slot.state == "ready" and runtime.queued_requests() == 0


def _wait_for(condition, timeout: float = 120.0):
    """condition()'s first true value, once the server has got there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{condition.__doc__} did not happen within {timeout} s")


def _log_line_with(runtime, needle: str) -> str:
    def found():
        """the log line"""
        return next((line for line in tail(log_path(runtime.store), 200) if needle in line), None)

    return _wait_for(found)


def test_a_client_leaving_mid_stream_frees_the_engine(served, oai):
    runtime, server = served
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 200, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    line = _log_line_with(runtime, "cancelled (the client left)")
    assert "/v1/completions" in line and int(line.split(" output tokens")[0].split()[-1]) < 200
    reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **GREEDY)
    assert reply.usage.completion_tokens == 2


def test_a_client_leaving_the_queue_is_dropped_from_it(served):
    runtime, server = served
    running = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1000, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=running, timeout=120) as response:
        # The line iterator stays referenced: a collected one closes the stream, and the server rightly cancels.
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": True}).encode()
        waiting = socket.create_connection(("127.0.0.1", server.port))
        waiting.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: local\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

        def one_waits():
            """one request waiting in the queue"""
            return runtime.queued_requests() == 1

        def none_waits():
            """the queue emptied"""
            return runtime.queued_requests() == 0

        _wait_for(one_waits)
        waiting.close()
        _wait_for(none_waits)
        assert runtime.slot.state == "busy"  # the first request still runs: only the waiter left
    _log_line_with(runtime, "the client left while waiting in the queue")
