"""The embedded model's chat template with tools: conversations without tools render
exactly as the model was trained on; with tools, the tool list, assistant calls and tool
results render in the Hermes layout, as transformers' ``apply_chat_template`` renders them;
anchors stay exact (QUEUE-16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from http_fakes import TinyCodec

from app.chat_template import ChatTemplate, tokenize_chat
from app.errors import ApiError
from app.request_parsing import ChatMessage, parse_chat
from ops.training.special_tokens import CHAT_TEMPLATE, render_chat

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "default"
EMBEDDED_TEMPLATE: str = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())[
    "chat_template"]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & 'later'",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_HISTORY: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
]


def template() -> ChatTemplate:
    return ChatTemplate(EMBEDDED_TEMPLATE, {})


def parsed(messages: list[Any], **fields: Any) -> tuple[tuple[ChatMessage, ...], Any]:
    params = parse_chat({"messages": messages, **fields})
    return params.messages, params.tools.offered if params.tools else ()


def test_the_model_ships_the_template_flare_trains_with() -> None:
    assert EMBEDDED_TEMPLATE == CHAT_TEMPLATE
    draft = json.loads((MODEL_DIR.parent / "default-draft" / "tokenizer_config.json")
                       .read_text())["chat_template"]
    assert draft == CHAT_TEMPLATE


@pytest.mark.parametrize("pairs", [
    [("user", "hi")],
    [("system", "Be brief."), ("user", "Reverse a list.")],
    [("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "")],
    [("user", "x <tool_call> y"), ("assistant", "")],
])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_conversations_without_tools_render_as_trained(pairs: list[tuple[str, str]],
                                                       generation_prompt: bool) -> None:
    messages = tuple(ChatMessage(role=r, content=c) for r, c in pairs)
    assert template().render(messages, add_generation_prompt=generation_prompt) == render_chat(
        pairs, add_generation_prompt=generation_prompt)


def test_unknown_roles_are_still_refused() -> None:
    with pytest.raises(ApiError) as info:
        template().render((ChatMessage(role="developer", content="x"),),
                          add_generation_prompt=True)
    assert info.value.param == "messages"


def test_tools_calls_and_results_render_in_the_hermes_layout() -> None:
    messages, tools = parsed(TOOL_HISTORY, tools=TOOLS)
    text = template().render(messages, add_generation_prompt=True, tools=tools)
    assert text.startswith("<|system|>\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in text  # '<' and '&' unescaped
    assert text.count("<|system|>") == 1  # the system message joins the tools turn
    assert ("<|assistant|>\nChecking both.\n<tool_call>\n{\"name\": \"get_weather\", "
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": "
            "\"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|end|>\n"
            ) in text
    assert text.endswith("<|user|>\n<tool_response>\nsunny\n</tool_response><|end|>\n"
                         "<|user|>\n<tool_response>\nrain\n</tool_response><|end|>\n"
                         "<|assistant|>\n")
    # Without a system message the tools turn comes first on its own.
    messages, tools = parsed(TOOL_HISTORY[1:2], tools=TOOLS)
    alone = template().render(messages, add_generation_prompt=False, tools=tools)
    assert alone.startswith("<|system|>\n# Tools\n")
    assert alone.endswith("</tool_call><|end|>\n<|user|>\nWeather in Paris and Rome?<|end|>\n")


@pytest.mark.slow
def test_flare_renders_tools_as_transformers_does() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    messages, tools = parsed(TOOL_HISTORY, tools=TOOLS)
    expected = tokenizer.apply_chat_template(TOOL_HISTORY, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)
    assert template().render(messages, add_generation_prompt=True, tools=tools) == expected


def test_queue_16_tool_turns_keep_earlier_tokens(codec: TinyCodec) -> None:
    """Segmented tokenization with tools: the next turn's prompt starts with this turn's
    tokens, and every message end is an anchor."""
    first, tools = parsed(TOOL_HISTORY[:3], tools=TOOLS)
    second, _ = parsed(TOOL_HISTORY, tools=TOOLS)
    t1 = tokenize_chat(template(), codec, first, tools=tools)
    t2 = tokenize_chat(template(), codec, second, tools=tools)
    assert len(t2.message_ends) == len(TOOL_HISTORY)
    shared = t1.message_ends[-1]
    assert t2.token_ids[:shared] == t1.token_ids[:shared]
    assert t2.system_end == t2.message_ends[0]
    assert codec.decode(t2.token_ids) == template().render(second, add_generation_prompt=True,
                                                           tools=tools)
