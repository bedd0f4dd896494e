"""Attention of the packed decoder forward: which cached keys each query sees, and
grouped-query attention over a dense gather of a lane's pages.

Owns the masks of every program layout (one lane, several lanes packed, lane-major,
and a mixed frame's prompt and decode phases) and the sliding-window rule: a query at
position ``p`` with window ``w`` sees keys at positions ``p - w < k <= p`` (as
transformers' ``sliding_window_overlay``). Pages that fall out of a window stay in the
cache and are still gathered; the mask alone makes attention ignore them. Masks are
built once per forward for each distinct window of the model's layers. Shapes follow
the caller's buffers, so everything here is capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.model.batch import PackedBatch


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None
             ) -> torch.Tensor:
    """bool ``[Q, K]``: query ``q`` (at ``query_pos[q]``) sees key position ``k``."""
    seen = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        seen = seen & (key_pos[None, :] > query_pos[:, None] - window)
    return seen


def _stacked_mask(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask for ``grouped_attention``, built once per forward.

    ``mask`` bool ``[batches, 1, queries, S]`` (True: attend) becomes ``dtype``
    ``[batches, 1, group * queries, S]`` with 0 where attended and -inf elsewhere, in
    the stacked query order. SDPA would otherwise convert (and we expand) a bool mask
    in every layer.
    """
    batches, _, queries, keys = mask.shape
    if group > 1:
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(
            batches, 1, group * queries, keys
        )
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))


def attention_masks(batch: PackedBatch, page_size: int, window: int | None, group: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The additive masks of one forward for one window: ``(mask, prompt_mask)``.

    ``mask`` serves the decode phase of a mixed frame, or the whole forward otherwise;
    ``prompt_mask`` (mixed frames only) serves the prompt phase. Key index ``c`` of a
    lane's dense gather is position ``c``: block tables start at block 0.
    """
    n = batch.token_ids.shape[0]
    lanes = batch.lane_block_tables.shape[0]
    ctx = batch.lane_block_tables.shape[1] * page_size
    device = batch.positions.device
    key_pos = torch.arange(ctx, device=device)
    width = batch.lane_major_width
    split = batch.phase_split
    prompt_mask = None
    if split is not None:
        pos_ext = torch.cat((batch.positions, batch.positions.new_zeros(1)))
        p_len, p_table = split.prompt_slots.shape[0], split.prompt_block_table
        p_ctx = ctx if p_table is None else p_table.shape[1] * page_size
        p_key_pos = key_pos if p_table is None else torch.arange(p_ctx, device=device)
        prompt_mask = _stacked_mask(
            _visible(p_key_pos, pos_ext[split.prompt_slots], window).view(1, 1, p_len, p_ctx),
            group, dtype)
        mask = _visible(key_pos, pos_ext[split.decode_slots], window).view(
            lanes, 1, split.width, ctx)
    elif width:
        if n != lanes * width:
            raise ValueError("lane-major layout needs N == R * W")
        mask = _visible(key_pos, batch.positions, window).view(lanes, 1, width, ctx)
    elif lanes == 1:
        # one lane (prefill): every token belongs to it, no lane test needed
        mask = _visible(key_pos, batch.positions, window).view(1, 1, n, ctx)
    else:
        # mask[n, r*ctx + c]: token n sees key c of lane r iff r is its lane and c is visible.
        seen = _visible(key_pos, batch.positions, window)
        lanes_idx = torch.arange(lanes, device=device)
        lane_match = batch.token_lane[:, None] == lanes_idx[None, :]
        mask = (lane_match[:, :, None] & seen[:, None, :]).reshape(1, 1, n, lanes * ctx)
    return _stacked_mask(mask, group, dtype), prompt_mask


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    batches: int,
    queries: int,
    group: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head: the ``group`` query
    heads that share a KV head are stacked along the query axis.

    ``q`` ``[batches * queries, H, hd]``; ``keys``/``values`` ``[batches, S, kvh, hd]``;
    ``mask`` from ``attention_masks`` ``[batches, 1, group * queries, S]``. Returns
    ``[batches * queries, H * hd]`` (head ``h`` reads KV head ``h // group``, as in HF
    ``repeat_kv``). ``scale`` replaces ``hd ** -0.5``; ``softcap`` (Gemma2) caps the
    scores at ``softcap * tanh(scores / softcap)`` before the mask, which SDPA cannot do,
    so it runs the product, the cap and a float32 softmax explicitly, as transformers'
    eager attention does.
    """
    kv_heads, hd = keys.shape[2], keys.shape[3]
    stacked = (
        q.reshape(batches, queries, kv_heads, group, hd)
        .permute(0, 2, 3, 1, 4)
        .reshape(batches, kv_heads, group * queries, hd)
    )
    if softcap is None:
        out = F.scaled_dot_product_attention(
            stacked, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
        )
    else:
        scores = torch.matmul(stacked, keys.permute(0, 2, 3, 1)) * (scale or hd ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        weights = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, values.transpose(1, 2))
    return (
        out.view(batches, kv_heads, group, queries, hd)
        .permute(0, 3, 1, 2, 4)
        .reshape(batches * queries, kv_heads * group * hd)
    )
