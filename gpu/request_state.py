"""Device-resident request state, one row per state row.

Owns the tensors that programs read and write so that a decode frame can be queued
behind another decode frame with no host round trip (architecture: *Two frame slots,
device-resident feedback*): the pending token, the position (tokens already cached,
which is where the pending token goes), the block-table row, the sampling parameters
and the request seed. The RNG position is the sequence index of the token being
sampled, so randomness is keyed by (seed, position) and needs no extra counter.

Row ``state_rows`` (one past the last) is the *sink* row: inactive lanes point there,
its block table is all sink page, and nothing reads what programs write into it.
Host updates (initialise a row, append pages, copy a page in every pool of
``page_pools``) are applied by ``apply_updates`` inside a program's ``bind``, in
stream order. On the CPU the tensors are host memory, so
``host_views`` exposes numpy views of them: updates are plain array writes there and
``bind`` reads positions and temperatures without any tensor round trip.

Logit processing (``gpu.sampling.process_logits``) has its own per-row state: the
request's penalty and filter parameters; its logit bias, sparse (up to
``MAX_LOGIT_BIAS_ENTRIES`` (token id, bias) pairs per row, padded with id 0 and bias 0:
at a 152k vocabulary a dense ``[rows+1, V]`` bias was 4x slower to apply on the CPU and
150 MiB for 256 rows); masks ``[rows+1, V]`` of the ids that end the request (forbidden
under ``min_tokens``) and of the prompt tokens (for the repetition penalty); and what
programs update as they sample, inside the program, so that a decode frame queued
behind another still sees every token before it: per-token output counts
``[rows+1, V]`` and the generated-token count (``record_outputs``). ``processes`` is the
host-known flag that a row has any of it on; eager programs skip the processing when no
lane has (the result is the same: every neutral parameter leaves the logits unchanged).

``draft_position`` belongs to speculative loads whose learned draft context may lag
(``gpu.draft_state``): the draft's KV is current below it. A row starts with it equal
to its position (a cached prefix's pages carry their draft KV, see ``gpu.draft_state``);
only draft-side code moves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpu.frames import (
    MAX_LOGIT_BIAS_ENTRIES,
    TOP_LOGPROBS,
    FrameError,
    PageAppend,
    PageCopy,
    RowInit,
    StateUpdate,
)
from gpu.model.kv_cache import CacheGeometry, PagedKVCache
from gpu.sampling import RowProcessing

if TYPE_CHECKING:
    from gpu.grammar_rows import ResidentGrammars

NEUTRAL_PROCESSING = {"repetition_penalty": 1.0}
"""Processing fields whose off value is not zero (``processing_fields``)."""


class StateError(FrameError):
    """Raised when a frame names a state row, page or block outside the configured pool."""


class RequestState:
    """Per-row device tensors (``rows + 1`` rows, the last is the sink)."""

    def __init__(self, state_rows: int, geometry: CacheGeometry, *, vocab_size: int,
                 device: str) -> None:
        if state_rows < 1:
            raise ValueError("state_rows must be positive")
        self.rows = state_rows
        self.vocab_size = vocab_size
        self.sink_row = state_rows
        self.geometry = geometry
        n = state_rows + 1
        i64 = torch.int64
        self.pending_token = torch.zeros(n, dtype=i64, device=device)
        self.position = torch.zeros(n, dtype=i64, device=device)
        self.draft_position = torch.zeros(n, dtype=i64, device=device)
        self.block_table = torch.full(
            (n, geometry.blocks_per_row), geometry.sink_page, dtype=i64, device=device
        )
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=i64, device=device)
        self.seed = torch.zeros(n, dtype=i64, device=device)
        self.top_logprobs = torch.full((n,), TOP_LOGPROBS, dtype=i64, device=device)
        """Top alternatives each row's samples carry (``RowInit.top_logprobs``)."""
        f32, b8 = torch.float32, torch.bool
        self.processes = torch.zeros(n, dtype=b8, device=device)
        self.presence_penalty = torch.zeros(n, dtype=f32, device=device)
        self.frequency_penalty = torch.zeros(n, dtype=f32, device=device)
        self.repetition_penalty = torch.ones(n, dtype=f32, device=device)
        self.min_p = torch.zeros(n, dtype=f32, device=device)
        self.min_tokens = torch.zeros(n, dtype=i64, device=device)
        self.generated = torch.zeros(n, dtype=i64, device=device)
        """Output tokens sampled so far (``min_tokens``)."""
        self.logit_bias_ids = torch.zeros((n, MAX_LOGIT_BIAS_ENTRIES), dtype=i64, device=device)
        self.logit_bias_values = torch.zeros((n, MAX_LOGIT_BIAS_ENTRIES), dtype=f32,
                                             device=device)
        self.output_counts = torch.zeros((n, vocab_size), dtype=f32, device=device)
        """How often each token was sampled as output (presence / frequency penalties)."""
        self.prompt_seen = torch.zeros((n, vocab_size), dtype=b8, device=device)
        self.end_tokens = torch.zeros((n, vocab_size), dtype=b8, device=device)
        self.host_views: dict[str, np.ndarray] | None = (
            {name: t.numpy() for name, t in self.fields().items()}
            if torch.device(device).type == "cpu" else None
        )
        """Numpy views sharing the tensors' memory (CPU only; None on a device)."""
        self.page_pools: list[PagedKVCache] = []
        """The page pools the block tables address (the target's KV, a learned draft's):
        a ``PageCopy`` copies its page in each."""
        self.grammars: ResidentGrammars | None = None
        """The rows' resident grammar matchers (``gpu.grammar_rows``), set before the
        programs are prepared on a backend that can hold them; None: grammars stay on
        the host and frames carry their masks."""

    def fields(self) -> dict[str, torch.Tensor]:
        """Every per-row tensor by name (snapshot/restore copy all of them)."""
        return {
            "pending_token": self.pending_token,
            "position": self.position,
            "draft_position": self.draft_position,
            "block_table": self.block_table,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "top_logprobs": self.top_logprobs,
            **self.processing_fields(),
        }

    def processing_fields(self) -> dict[str, torch.Tensor]:
        """The logit-processing tensors by name (a row copy that replaces the sampling
        resets them: ``NEUTRAL_PROCESSING``, else zero)."""
        return {
            "processes": self.processes,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "generated": self.generated,
            "logit_bias_ids": self.logit_bias_ids,
            "logit_bias_values": self.logit_bias_values,
            "output_counts": self.output_counts,
            "prompt_seen": self.prompt_seen,
            "end_tokens": self.end_tokens,
        }

    def processing(self, rows: torch.Tensor) -> RowProcessing:
        """The logit-processing state of ``rows`` (int64 ``[N]``), gathered."""
        return RowProcessing(
            presence=self.presence_penalty[rows], frequency=self.frequency_penalty[rows],
            repetition=self.repetition_penalty[rows], min_p=self.min_p[rows],
            bias_ids=self.logit_bias_ids[rows], bias_values=self.logit_bias_values[rows],
            counts=self.output_counts[rows],
            prompt_seen=self.prompt_seen[rows], end_tokens=self.end_tokens[rows],
            generated=self.generated[rows], min_tokens=self.min_tokens[rows],
        )

    def any_processing(self, rows: Sequence[int]) -> bool:
        """Whether any of ``rows`` has logit processing on, read on the host (eager
        programs skip the processing and its state updates otherwise)."""
        if self.host_views is not None:
            return bool(self.host_views["processes"][list(rows)].any())
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.processes.device)
        return bool(self.processes.index_select(0, index).any().item())

    def record_outputs(self, rows: torch.Tensor, tokens: torch.Tensor,
                       emitted: torch.Tensor) -> None:
        """Count sampled output tokens into the penalty state, inside a program:
        ``tokens [N, K]`` of ``rows [N]`` where ``emitted [N, K]`` (bool); duplicate rows
        (the sink) accumulate."""
        k = tokens.shape[1]
        flat_rows = rows[:, None].expand(-1, k).reshape(-1)
        ones = emitted.reshape(-1).to(torch.float32)
        self.output_counts.index_put_((flat_rows, tokens.clamp(min=0).reshape(-1)), ones,
                                      accumulate=True)
        self.generated.index_add_(0, rows, emitted.sum(dim=1).to(torch.int64))

    def check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise StateError(f"state row {row} outside 0..{self.rows - 1}")

    def check_page(self, page: int) -> None:
        if not 0 <= page < self.geometry.num_pages:
            raise StateError(f"page {page} outside 0..{self.geometry.num_pages - 1}")

    def validate_updates(self, updates: Sequence[StateUpdate]) -> None:
        """Reject malformed updates before anything is written."""
        for update in updates:
            self.check_row(update.row)
            if isinstance(update, RowInit):
                if not 0 <= update.position < self.geometry.max_context:
                    raise StateError(f"position {update.position} outside the context")
                ids = (*update.prompt_tokens, *update.end_token_ids,
                       *(t for t, _ in update.sampling.logit_bias))
                if any(not 0 <= t < self.vocab_size for t in ids):
                    raise StateError(f"a row's token ids must lie in 0..{self.vocab_size - 1}")
                if update.grammar and self.grammars is None:
                    raise StateError("these programs hold no resident grammars")
            elif isinstance(update, PageCopy):
                self.check_page(update.src_page)
                self.check_page(update.dst_page)
            else:
                end = update.first_block + len(update.page_ids)
                if update.first_block < 0 or end > self.geometry.blocks_per_row:
                    raise StateError(
                        f"blocks {update.first_block}..{end - 1} outside the block table "
                        f"(0..{self.geometry.blocks_per_row - 1})"
                    )
                for page in update.page_ids:
                    self.check_page(page)

    def apply_updates(self, updates: Sequence[StateUpdate]) -> None:
        """Validate, then apply host updates in order (call inside ``bind``, in stream
        order)."""
        self.validate_updates(updates)
        if not updates:
            return
        host = self.host_views
        for update in updates:
            if isinstance(update, PageCopy):
                pages = torch.tensor([update.src_page, update.dst_page], dtype=torch.int64,
                                     device=self.block_table.device)
                for pool in self.page_pools:
                    pool.copy_pages(pages[:1], pages[1:])
                continue
            if self.grammars is not None and isinstance(update, RowInit):
                self.grammars.init_row(update)
            if host is not None:
                _apply_on_host(host, update, self.geometry.sink_page)
            elif isinstance(update, RowInit):
                r = update.row
                s = update.sampling
                self.position[r] = update.position
                self.draft_position[r] = update.position
                self.pending_token[r] = update.pending_token
                self.temperature[r] = s.temperature
                self.top_p[r] = s.top_p
                self.top_k[r] = s.top_k
                self.seed[r] = s.row_seed
                self.top_logprobs[r] = update.top_logprobs
                self.block_table[r] = self.geometry.sink_page
                self._init_processing(update)
            elif isinstance(update, PageAppend):
                end = update.first_block + len(update.page_ids)
                self.block_table[update.row, update.first_block:end] = torch.tensor(
                    update.page_ids, dtype=torch.int64, device=self.block_table.device)

    def _init_processing(self, update: RowInit) -> None:
        r = update.row
        for name, value in _processing_values(update).items():
            tensor = getattr(self, name)
            if isinstance(value, tuple):
                ids, values = value
                tensor[r] = 0
                if ids:
                    index = torch.tensor(ids, dtype=torch.int64, device=tensor.device)
                    tensor[r].index_put_((index,), torch.tensor(
                        values, dtype=tensor.dtype, device=tensor.device))
            else:
                tensor[r] = value


def _processing_values(update: RowInit) -> dict[str, float | int | bool | tuple[Any, Any]]:
    """A new row's logit-processing state: scalars, and rows as ``(columns, values)``
    over zeros (a dense row's columns are token ids); the counts start empty."""
    s = update.sampling
    on = s.processes_logits
    bias = s.logit_bias if on else ()
    prompt = sorted(set(update.prompt_tokens)) if on and s.repetition_penalty != 1.0 else []
    ends = sorted(set(update.end_token_ids)) if on and s.min_tokens > 0 else []
    return {
        "processes": on, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "repetition_penalty": s.repetition_penalty,
        "min_p": s.min_p, "min_tokens": s.min_tokens, "generated": 0,
        "logit_bias_ids": (list(range(len(bias))), [t for t, _ in bias]),
        "logit_bias_values": (list(range(len(bias))), [b for _, b in bias]),
        "output_counts": ([], []),
        "prompt_seen": (prompt, [True] * len(prompt)),
        "end_tokens": (ends, [True] * len(ends)),
    }


def _apply_on_host(host: dict[str, np.ndarray], update: StateUpdate, sink_page: int) -> None:
    """One update written straight into the CPU tensors' memory (same values and
    dtype conversions as the tensor writes)."""
    r = update.row
    if isinstance(update, RowInit):
        s = update.sampling
        host["position"][r] = update.position
        host["draft_position"][r] = update.position
        host["pending_token"][r] = update.pending_token
        host["temperature"][r] = s.temperature
        host["top_p"][r] = s.top_p
        host["top_k"][r] = s.top_k
        host["seed"][r] = s.row_seed
        host["top_logprobs"][r] = update.top_logprobs
        host["block_table"][r] = sink_page
        for name, value in _processing_values(update).items():
            if isinstance(value, tuple):  # a row: reset, then set the named columns
                ids, values = value
                host[name][r] = 0
                host[name][r, list(ids)] = values
            else:
                host[name][r] = value
    elif isinstance(update, PageAppend):
        end = update.first_block + len(update.page_ids)
        host["block_table"][r, update.first_block:end] = update.page_ids
