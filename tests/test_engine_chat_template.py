"""Chat templates rendered by the engine against transformers' own rendering."""

from __future__ import annotations

import pytest

from engine.chat_template import ChatTemplate
from engine.errors import EngineError
from engine.gguf_file import GGUFFile

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one, in français s'il vous plaît 🍐"},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  \n"}],
]

# Exercises what transformers' environment adds: tojson without HTML escaping, loop controls,
# raise_exception, lstrip/trim of block tags, the special-token variables.
TOOLISH_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
    <{{ message['role'] }}>{{ message | tojson }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token if not add_generation_prompt }}"""


def transformers_render(source, messages, special, add_generation_prompt=True):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=source, add_generation_prompt=add_generation_prompt, **special
    )
    return rendered[0]


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf):
    return ChatTemplate.from_gguf(GGUFFile(smollm2_gguf))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_gguf_template_matches_transformers_tokenizer(hf_tokenizer, smollm2_template, messages):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2_template.render(messages) == expected
    assert smollm2_template.render(messages).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_environment_matches_transformers(messages, add_generation_prompt):
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = ChatTemplate(TOOLISH_TEMPLATE, special).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == transformers_render(TOOLISH_TEMPLATE, messages, special, add_generation_prompt)
    assert "🍐" in ours or "🍐" not in str(messages)


def test_template_exception_becomes_engine_error():
    template = ChatTemplate(TOOLISH_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(EngineError, match="tool messages are not supported"):
        template.render([{"role": "tool", "content": "42"}])


@pytest.mark.parametrize(
    "messages, fragment",
    [([], "non-empty list"), ([{"content": "x"}], "role"), ([{"role": "user", "content": None}], "content")],
)
def test_malformed_messages_are_explained(messages, fragment):
    with pytest.raises(EngineError, match=fragment):
        ChatTemplate("{{ messages }}", {}).render(messages)


def test_syntax_error_is_explained():
    with pytest.raises(EngineError, match="syntax error"):
        ChatTemplate("{% for m in messages %}", {}, "broken.gguf")
