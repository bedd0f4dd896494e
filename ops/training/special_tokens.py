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
# Roles other than system/user/assistant are refused, as transformers templates do.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
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
