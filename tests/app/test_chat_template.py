"""Chat templating: sandboxed rendering and exact message-end anchors (QUEUE-16, QUEUE-17, QUEUE-18, QUEUE-19 via
OPEN-23; system boundary OPEN-36)."""

from __future__ import annotations

import pytest
from http_fakes import TinyCodec

from app.chat_template import ChatTemplate, ChatTemplateError, tokenize_chat
from app.errors import ApiError
from app.request_parsing import ChatMessage


def conversation(*pairs: tuple[str, str]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(role=role, content=content) for role, content in pairs)


def template_for(codec: TinyCodec, source: str | None = None) -> ChatTemplate:
    return ChatTemplate(source if source is not None else codec.chat_template,
                        codec.special_tokens)


def test_open_23_anchors_are_exact_token_offsets(codec: TinyCodec) -> None:
    messages = conversation(("system", "Be brief."), ("developer", "Use Python."),
                            ("user", "Hello there"), ("assistant", "Hi!"), ("user", "Again"))
    chat = tokenize_chat(template_for(codec), codec, messages)
    assert len(chat.message_ends) == 5
    assert list(chat.message_ends) == sorted(set(chat.message_ends))
    rendered = [codec.decode(chat.token_ids[:end]) for end in chat.message_ends]
    for message, text in zip(messages, rendered, strict=True):
        assert text.endswith(f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n")
    # OPEN-36: the system boundary is the end of the leading system/developer messages.
    assert chat.system_end == chat.message_ends[1]
    assert codec.decode(chat.token_ids) == template_for(codec).render(
        messages, add_generation_prompt=True)


def test_queue_16_next_turn_reproduces_earlier_tokens(codec: TinyCodec) -> None:
    """Segmented tokenization makes turn n's prompt a token prefix of turn n+1's."""
    first = conversation(("user", "Tell me about foxes"))
    second = (*first, *conversation(("assistant", "Quick brown ones."), ("user", "More")))
    t1 = tokenize_chat(template_for(codec), codec, first)
    t2 = tokenize_chat(template_for(codec), codec, second)
    shared = t1.message_ends[-1]
    assert t2.token_ids[:shared] == t1.token_ids[:shared]
    assert t2.message_ends[0] == shared
    assert t1.system_end is None


def test_long_conversations_anchor_the_system_end_and_recent_messages(codec: TinyCodec) -> None:
    """Anchoring renders prefixes; only the system boundary and the last
    MAX_RECENT_ANCHORS messages are anchored, so cost stays linear in the length."""
    from app.chat_template import MAX_RECENT_ANCHORS

    turns = [("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(100)]
    messages = conversation(("system", "sys"), *turns)
    chat = tokenize_chat(template_for(codec), codec, messages)
    assert len(chat.message_ends) == 1 + MAX_RECENT_ANCHORS
    assert chat.system_end == chat.message_ends[0]
    assert codec.decode(chat.token_ids[:chat.message_ends[0]]).endswith("sys<|im_end|>\n")
    assert codec.decode(chat.token_ids[:chat.message_ends[1]]).endswith(
        f"turn {100 - MAX_RECENT_ANCHORS}<|im_end|>\n")
    assert codec.decode(chat.token_ids) == template_for(codec).render(
        messages, add_generation_prompt=True)


def test_fallback_template_when_model_has_none(codec: TinyCodec) -> None:
    template = ChatTemplate(None, codec.special_tokens)
    assert template.uses_fallback
    chat = tokenize_chat(template, codec, conversation(("user", "hi")))
    assert codec.decode(chat.token_ids) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors_are_bad_requests(codec: TinyCodec) -> None:
    with pytest.raises(ApiError) as info:
        template_for(codec).render(conversation(("assistant", "x")), add_generation_prompt=True)
    assert info.value.status == 400
    assert "must not start with an assistant" in info.value.message


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for m in messages %}{{ m.content.format.__globals__['os'] }}{% endfor %}",
])
def test_sandbox_blocks_unsafe_access(codec: TinyCodec, source: str) -> None:
    template = ChatTemplate(source, codec.special_tokens)
    with pytest.raises(ApiError) as info:
        template.render(conversation(("user", "hi")), add_generation_prompt=True)
    assert info.value.status == 400


def test_broken_template_fails_at_startup(codec: TinyCodec) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", codec.special_tokens)
