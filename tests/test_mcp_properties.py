"""Every tool, called through the official `mcp` client with random arguments drawn from its own published input
schema and with mutated ones (wrong types, unknown keys, out-of-range numbers, huge strings): no traceback, no
bare "Error executing tool", and every refusal one sentence on one line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_support import connect

from setup_logic.catalog import load_catalog
from strata_mcp.tools import ALL_TOOLS

pytestmark = pytest.mark.slow

# Nothing may be downloaded: no hub answers on this port, and an install that would start is pointed elsewhere.
CLOSED_PORT = "http://127.0.0.1:9"
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
HUGE_TEXT = st.integers(10_000, 200_000).map(lambda n: "x" * n)
OUT_OF_RANGE = st.sampled_from([-(10**15), -1, 0, 10**15, -1e300, 1e300, 2**63])


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values that satisfy the JSON schema forms pydantic publishes for the tools' inputs."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(option, defs) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = {name: from_schema(sub, defs) for name, sub in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        return st.lists(from_schema(schema["items"], defs), max_size=min(schema.get("maxItems", 4), 4))
    if kind == "string":
        return st.text(max_size=40)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
    if kind == "integer":
        low = None if low is None else low + ("exclusiveMinimum" in schema)
        return st.integers(min_value=low, max_value=high)
    if kind == "number":
        return st.floats(min_value=low, max_value=high, exclude_min="exclusiveMinimum" in schema,
                         allow_nan=False, allow_infinity=False)
    raise AssertionError(f"schema form not covered: {schema}")


@st.composite
def mutated(draw, valid: st.SearchStrategy, names: list[str]) -> dict[str, Any]:
    args = dict(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names)) if names else draw(st.text(min_size=1, max_size=12))
        args[name] = draw(st.one_of(ANY_JSON, HUGE_TEXT, OUT_OF_RANGE))
    if draw(st.booleans()):
        args[draw(st.text(max_size=300))] = draw(ANY_JSON)  # an unknown key
    return args


def no_download(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """An install that would really start (confirm, a catalog model) is pointed at a model that is not there."""
    if tool == "install" and args.get("confirm") not in (None, False, 0, "false", "0", "no", "off", "f", "n"):
        if not isinstance(args.get("model"), str) or args["model"] in CATALOG_IDS:
            return {**args, "model": "not-in-the-catalog"}
    return args


CATALOG_IDS = {m.id for m in load_catalog()} | {None}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("properties") / "data"
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(
        connect(data, HF_ENDPOINT=CLOSED_PORT, PIP_INDEX_URL=CLOSED_PORT, PIP_NO_INDEX="1")
    ) as session:
        schemas = {tool.name: tool.input_schema for tool in portal.call(session.list_tools).tools}
        yield portal, session, schemas


def check_answer(tool: str, args: dict[str, Any], result) -> None:
    text = " ".join(getattr(c, "text", "") for c in result.content)
    assert "Traceback" not in text and not text.startswith("Error executing tool"), (args, text)
    if result.is_error:
        assert "\n" not in text and text.endswith(".") and len(text) <= 400, (args, text)
    else:
        assert result.structured_content and result.structured_content["summary"], (args, text)


@pytest.mark.parametrize("tool", [spec.name for spec in ALL_TOOLS])
def test_random_and_mutated_arguments_get_an_answer_or_one_sentence(server, tool):
    portal, session, schemas = server
    schema = schemas[tool]
    valid = from_schema(schema, schema.get("$defs", {}))

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(args=st.one_of(valid, mutated(valid, list(schema.get("properties", {})))))
    def check(args):
        args = no_download(tool, json.loads(json.dumps(args)))
        result = portal.call(lambda: session.call_tool(tool, args, read_timeout_seconds=120))
        check_answer(tool, args, result)

    check()
