"""The embedded default model's special tokens and chat format, in one place.

The tokenizer's special tokens, the Jinja ``chat_template`` written to ``tokenizer_config.json``
and the Python renderer the corpus uses to build chat training documents all come from here, so
training text and served prompts cannot drift apart (a test renders both and compares).
"""

from __future__ import annotations

from collections.abc import Sequence

END_OF_TEXT = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"

# Order fixes the ids: <|endoftext|> is 0, and so on.
SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, SYSTEM, USER, ASSISTANT, END)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# Each message is "<|role|>\n{content}<|end|>\n"; the generation prompt is "<|assistant|>\n".
# Roles other than system/user/assistant/tool are refused, as transformers templates do.
# With ``tools`` the first turn is a system turn listing them (the system message's text, if
# any, first), in the Hermes/Qwen layout; an assistant turn's ``tool_calls`` follow its text as
# ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` blocks, and a ``tool``
# message is a user turn holding ``<tool_response>\n...\n</tool_response>``. A conversation
# without tools renders exactly as before tools existed.
TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_INTRO + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_OUTRO + "<|end|>\\n' }}"
    "{% endif %}"
    "{% if loop.first and tools and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{% else %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user, assistant and tool roles are supported') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for tool_call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + tool_call['function']['name'] + '\", \"arguments\": ' }}"
    "{% if tool_call['function']['arguments'] is string %}"
    "{{ tool_call['function']['arguments'] }}"
    "{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
    """The text ``CHAT_TEMPLATE`` renders for ``(role, content)`` pairs."""
    parts = []
    for role, content in messages:
        if role not in ROLE_TOKENS:
            raise ValueError(f"unsupported chat role {role!r}: use system, user or assistant")
        parts.append(f"{ROLE_TOKENS[role]}\n{content}{END}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT}\n")
    return "".join(parts)
