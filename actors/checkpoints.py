"""Checkpoint anchors: which token endpoints a request's published state is kept for.

Seed *Planning and the execution queue*: retention uses the exact endpoints the
frontend supplied (``GenerationRequest.message_ends``, QUEUE-16); the last eligible
completed message is the best-effort conversation anchor (QUEUE-17), the prompt end
substitutes when there is none (QUEUE-18), and earlier messages follow in reverse
order, then a distinct prompt end (QUEUE-19).

flare's models keep all of their state in KV pages, so a checkpoint at endpoint ``e``
is the chain of full pages below ``e``; an anchor decides the *role* those pages carry
in eviction (``prefix_cache.CheckpointRole``). An anchor never needs an extra prefill
cut (``docs/runtime.md``, *Checkpoints*); the extra-work allowance that pays for the
snapshot copies flare can run is the scheduler's (``policy/checkpoint_allowance.py``,
QUEUE-20..26). Pure functions only.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.prefix_cache import CheckpointRole


def anchor_order(
    prompt_len: int, message_ends: Sequence[int], *, cached_tokens: int = 0
) -> tuple[int, ...]:
    """Candidate anchors, best first (QUEUE-17..19).

    Eligible messages end strictly after the cached prefix and strictly before the
    prompt end (a message ending at the prompt end *is* the prompt end). The prompt
    end comes last, once.
    """
    eligible = sorted(
        {e for e in message_ends if cached_tokens < e < prompt_len}, reverse=True
    )
    return (*eligible, prompt_len)


def checkpoint_roles(
    *,
    prompt_len: int,
    message_ends: Sequence[int],
    kv_tokens: int,
    page_size: int,
    terminal: bool,
) -> dict[int, CheckpointRole]:
    """The role of each published page that ends a checkpoint.

    A checkpoint at endpoint ``e`` is kept as its last full page (index
    ``e // page_size - 1``); endpoints inside the first page have none. With
    ``terminal`` (the end of a request, OPEN-35) the page holding the last written
    position (a partial tail when unaligned) carries the terminal role.
    """
    roles: dict[int, CheckpointRole] = {}

    def mark(endpoint: int, role: CheckpointRole) -> None:
        index = min(endpoint, kv_tokens) // page_size - 1
        if index >= 0:
            roles[index] = max(roles.get(index, CheckpointRole.INTERIOR), role)

    for endpoint in anchor_order(prompt_len, message_ends):
        role = CheckpointRole.PROMPT_END if endpoint == prompt_len else CheckpointRole.MESSAGE
        mark(endpoint, role)
    if terminal and kv_tokens > 0:
        # The page holding the last written position: a partial tail when unaligned.
        index = (kv_tokens - 1) // page_size
        roles[index] = max(roles.get(index, CheckpointRole.INTERIOR), CheckpointRole.TERMINAL)
    return roles
