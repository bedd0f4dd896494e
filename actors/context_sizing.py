"""How long a context the runtime serves and how many KV pages it keeps, and a warning
for every value that ends up smaller than a flag asked for.

``size_context`` decides (pure): the context is the asked ``--max-context``, lowered to
the model's ``max_position_embeddings``; the pool is ``--kv-pages`` (or enough for
``max_batch`` full contexts, or on a device what ``--gpu-memory-utilization`` leaves
after the weights), and a pool smaller
than one context shrinks the usable context to the pool. ``serving_context`` decides
and logs each adjustment as a ``config.adjusted`` warning naming the flag, the value
given, and the asked and used values (docs/logging.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from actors.catalog_setup import default_pages
from actors.config import ConfigError, RuntimeConfig
from gpu import ModelConfig, device_memory, load_model_config
from gpu.engine import resolve_dtype

log = structlog.get_logger("flare.runtime")

NO_DEVICE_MEMORY = ("the backend has no device memory to size; the KV pool follows "
                    "--kv-pages or --max-batch")
PAGES_GIVEN = "--kv-pages sets the KV pool"
"""Why ``--gpu-memory-utilization`` is not used."""

ACTIVATION_RESERVE_FRACTION = 0.05
MIN_ACTIVATION_RESERVE_BYTES = 512 * 2**20
"""Device memory kept out of the KV pool for activations and the captured graphs' pool:
5 % of the device, at least 512 MiB."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """What sizing the KV pool from ``--gpu-memory-utilization`` needs to know."""

    free_bytes: int
    """Free on the device before the model is loaded (others' use is not ours)."""
    total_bytes: int
    weight_bytes: int
    """The weights this runtime will load (target and draft)."""
    page_bytes: int
    """One KV page across every layer (target and draft)."""


def pages_for_memory(share: float, memory: DeviceMemory) -> int:
    """KV pages that fit in ``share`` of the device: the share of its total memory,
    less what is already in use, the weights and the activation reserve (vLLM's
    meaning of ``--gpu-memory-utilization``: the fraction of the device this server
    may take)."""
    reserve = max(MIN_ACTIVATION_RESERVE_BYTES,
                  int(ACTIVATION_RESERVE_FRACTION * memory.total_bytes))
    in_use = memory.total_bytes - memory.free_bytes
    budget = int(share * memory.total_bytes) - in_use - memory.weight_bytes - reserve
    return max(budget // memory.page_bytes, 0)


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


def size_context(config: RuntimeConfig, *, model_max_context: int,
                 memory: DeviceMemory | None = None) -> ContextSizing:
    """The served context and page pool of ``config`` for a model of
    ``model_max_context`` positions; with ``--gpu-memory-utilization`` and the device's
    ``memory`` (and no ``--kv-pages``) the pool is what fits in that share."""
    asked = config.max_context
    max_context = min(asked or model_max_context, model_max_context)
    adjustments: list[Adjustment] = []
    if asked is not None and asked > model_max_context:
        adjustments.append(Adjustment(
            flag="--max-context", value=asked, setting="max_context", asked=asked,
            used=model_max_context, reason="the model's max_position_embeddings"))
    share = config.gpu_memory_utilization
    if config.kv_pages is None and share is not None and memory is not None:
        pages = pages_for_memory(share, memory)
        needed = -(-max_context // config.page_size)
        if pages < needed:
            raise ConfigError(
                f"--gpu-memory-utilization {share} leaves room for {pages} KV pages, fewer "
                f"than one {max_context}-token context needs ({needed}): raise it, or lower "
                "--max-model-len")
    else:
        pages = config.kv_pages or default_pages(config.max_batch, max_context,
                                                 config.page_size)
    pool = pages * config.page_size
    if pool < max_context:
        adjustments.append(Adjustment(
            flag="--kv-pages", value=pages, setting="max_context", asked=max_context, used=pool,
            reason=f"{pages} KV pages of {config.page_size} tokens hold {pool} tokens"))
    return ContextSizing(max_context=max_context, num_pages=pages,
                         adjustments=tuple(adjustments))


def serving_context(config: RuntimeConfig, *, model_max_context: int,
                    memory: DeviceMemory | None = None) -> ContextSizing:
    """``size_context``, logging each adjustment as a warning, a
    ``--gpu-memory-utilization`` that sized nothing as ``config.ignored``, and the pool
    it sized as ``config.kv_pool``."""
    share = config.gpu_memory_utilization
    if share is not None and (memory is None or config.kv_pages is not None):
        log.warning("config.ignored", flag="--gpu-memory-utilization", value=share,
                    reason=PAGES_GIVEN if config.kv_pages is not None else NO_DEVICE_MEMORY)
    sizing = size_context(config, model_max_context=model_max_context, memory=memory)
    if share is not None and memory is not None and config.kv_pages is None:
        log.info("config.kv_pool", flag="--gpu-memory-utilization", value=share,
                 pages=sizing.num_pages, page_bytes=memory.page_bytes,
                 weight_bytes=memory.weight_bytes, free_bytes=memory.free_bytes,
                 total_bytes=memory.total_bytes)
    for a in sizing.adjustments:
        log.warning("config.adjusted", flag=a.flag, value=a.value, setting=a.setting,
                    asked=a.asked, used=a.used, reason=a.reason)
    return sizing


def device_memory_for(config: RuntimeConfig, device: str, model: ModelConfig
                      ) -> DeviceMemory | None:
    """What sizing the KV pool from ``--gpu-memory-utilization`` needs, read from the
    device before anything is loaded; None without the flag or on a CPU."""
    if config.gpu_memory_utilization is None:
        return None
    probed = device_memory(device)
    if probed is None:
        return None
    models = [model]
    if config.speculation != "off" and config.draft_source == "draft" and \
            config.draft_model_dir is not None:
        models.append(load_model_config(config.draft_model_dir))
    itemsize = resolve_dtype(device, config.dtype, model.torch_dtype).itemsize
    return DeviceMemory(
        free_bytes=probed[0], total_bytes=probed[1],
        weight_bytes=sum(m.parameter_count() for m in models) * itemsize,
        page_bytes=sum(m.kv_bytes_per_token(itemsize) for m in models) * config.page_size)
