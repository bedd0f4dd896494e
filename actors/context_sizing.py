"""How long a context the runtime serves and how many KV pages it keeps, and a warning
for every value that ends up smaller than a flag asked for.

``size_context`` decides (pure): the context is the asked ``--max-context``, lowered to
the model's ``max_position_embeddings``; the pool is ``--kv-pages`` (or enough for
``max_batch`` full contexts), and a pool smaller
than one context shrinks the usable context to the pool. ``serving_context`` decides
and logs each adjustment as a ``config.adjusted`` warning naming the flag, the value
given, and the asked and used values (docs/logging.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from actors.catalog_setup import default_pages
from actors.config import RuntimeConfig

log = structlog.get_logger("flare.runtime")

IGNORED_MEMORY_SHARE = {
    "cpu": "the cpu backend has no device memory to size; the KV pool follows --kv-pages "
           "or --max-batch",
    "cuda": "the cuda backend does not size its KV pool from device memory yet; the pool "
            "follows --kv-pages or --max-batch",
}
"""Why ``--gpu-memory-utilization`` is not used, by backend."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Adjustment:
    """A setting served smaller than asked, and the flag that caused it."""

    flag: str
    value: int | float
    """What the flag was given."""
    setting: str
    asked: int
    used: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextSizing:
    max_context: int
    """The context before the page pool's cap (``ModelEngine.load``'s ``max_context``);
    the usable context is ``min(max_context, num_pages * page_size)``."""
    num_pages: int
    adjustments: tuple[Adjustment, ...] = ()


def size_context(config: RuntimeConfig, *, model_max_context: int) -> ContextSizing:
    """The served context and page pool of ``config`` for a model of
    ``model_max_context`` positions."""
    asked = config.max_context
    max_context = min(asked or model_max_context, model_max_context)
    adjustments: list[Adjustment] = []
    if asked is not None and asked > model_max_context:
        adjustments.append(Adjustment(
            flag="--max-context", value=asked, setting="max_context", asked=asked,
            used=model_max_context, reason="the model's max_position_embeddings"))
    pages = config.kv_pages or default_pages(config.max_batch, max_context, config.page_size)
    pool = pages * config.page_size
    if pool < max_context:
        adjustments.append(Adjustment(
            flag="--kv-pages", value=pages, setting="max_context", asked=max_context, used=pool,
            reason=f"{pages} KV pages of {config.page_size} tokens hold {pool} tokens"))
    return ContextSizing(max_context=max_context, num_pages=pages,
                         adjustments=tuple(adjustments))


def serving_context(config: RuntimeConfig, *, model_max_context: int) -> ContextSizing:
    """``size_context``, logging each adjustment as a warning (and a
    ``--gpu-memory-utilization``, which no backend sizes its pool from yet, as
    ``config.ignored``)."""
    if config.gpu_memory_utilization is not None:
        log.warning("config.ignored", flag="--gpu-memory-utilization",
                    value=config.gpu_memory_utilization,
                    reason=IGNORED_MEMORY_SHARE.get(config.backend, IGNORED_MEMORY_SHARE["cpu"]))
    sizing = size_context(config, model_max_context=model_max_context)
    for a in sizing.adjustments:
        log.warning("config.adjusted", flag=a.flag, value=a.value, setting=a.setting,
                    asked=a.asked, used=a.used, reason=a.reason)
    return sizing
