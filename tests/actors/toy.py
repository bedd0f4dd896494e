"""A toy "model" for runtime tests: prepared programs that honour ``gpu.frames`` exactly
(row init, page appends, positions, pending tokens, paged KV) on host lists, so the
runtime's input packing, page tables and prefix reuse are checked end to end.

The next token is a deterministic function of the whole context *as read back through
the row's block table*, so a wrong page, a wrong position or a bad prefix-cache hit
changes the output. ``reference_output`` computes what a correct runtime must produce.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from actors.public import Finished, GenerationRequest, TextCodec, TokenDelta
from actors.system import Runtime, RuntimeParts, open_runtime_with
from gpu.backends.fake import FakeBackend
from gpu.frames import (
    RESULT_KEY,
    DecodeFrame,
    LaneSample,
    MixedFrame,
    PageAppend,
    PageCopy,
    PrefillFrame,
    RowInit,
    StateOpFrame,
    StateOpResult,
    StepResult,
    frame_of,
)
from policy.config import PolicyConfig
from policy.descriptors import GraphKind, GraphShape, StateOp

VOCAB = 40
EOS = VOCAB - 1
EOS_MAGIC = 7
"""A prompt starting with this token emits EOS once the context reaches 12 tokens."""
TOY_DEADLINE_S = 30
"""Every toy test finishes within this much virtual time (a hang fails, never blocks)."""
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?0123456789"


def next_token(context: Sequence[int]) -> int:
    if context and context[0] == EOS_MAGIC and len(context) >= 12:
        return EOS
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 31 + (i + 1) * t) % 1_000_003
    return acc % (VOCAB - 1)  # never EOS by accident


def reference_output(prompt: Sequence[int], max_tokens: int, *, ignore_eos: bool = False
                     ) -> list[int]:
    context = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(context)
        out.append(token)
        context.append(token)
        if token == EOS and not ignore_eos:
            break
    return out


class ToyCodec:
    """``TextCodec`` of the toy vocabulary: one character per id, EOS has no text."""

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(ALPHABET[t] for t in token_ids if t != EOS)

    @property
    def max_chars_per_token(self) -> int:
        return 1

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS,)

    @property
    def chat_template(self) -> str | None:
        return None

    @property
    def special_tokens(self) -> dict[str, str]:
        return {}


@dataclass(slots=True)
class _Row:
    position: int = 0
    pending: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ToyDevice:
    """Host-side stand-in for the device: rows and paged KV token storage."""

    page_size: int
    rows: dict[int, _Row] = field(default_factory=dict)
    kv: dict[int, dict[int, int]] = field(default_factory=dict)
    prompt_tokens_run: int = 0
    corrupt: list[Callable[[LaneSample], LaneSample]] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    """(source row, position, destination page) of every executed row copy."""
    page_copies: int = 0

    def apply(self, updates: Sequence[Any]) -> None:
        for update in updates:
            if isinstance(update, RowInit):
                self.rows[update.row] = _Row(position=update.position,
                                             pending=update.pending_token)
            elif isinstance(update, PageAppend):
                row = self.rows[update.row]
                assert len(row.blocks) == update.first_block, "page append out of order"
                row.blocks.extend(update.page_ids)
            elif isinstance(update, PageCopy):
                self.kv[update.dst_page] = dict(self.kv.get(update.src_page, {}))
                self.page_copies += 1
            else:
                raise AssertionError(f"unknown state update {update!r}")

    def write(self, row: _Row, token: int) -> None:
        page = row.blocks[row.position // self.page_size]
        self.kv.setdefault(page, {})[row.position % self.page_size] = token
        row.position += 1

    def context(self, row: _Row) -> list[int]:
        return [self.kv[row.blocks[p // self.page_size]][p % self.page_size]
                for p in range(row.position)]

    def sample(self, row_id: int) -> LaneSample:
        row = self.rows[row_id]
        token = next_token(self.context(row))
        row.pending = token
        sample = LaneSample(row=row_id, token=token, logprob=-0.5, finite=True)
        if self.corrupt:
            sample = self.corrupt.pop(0)(sample)
        return sample


class ToyProgram:
    """One prepared toy program (prefill or decode of one shape)."""

    def __init__(self, shape: GraphShape, device: ToyDevice) -> None:
        self._shape = shape
        self._device = device
        self._frame: Any = None
        self._result: StepResult | None = None
        self._state_lanes = 0

    @property
    def shape(self) -> GraphShape:
        return self._shape

    def bind(self, inputs: Mapping[str, Any]) -> None:
        frame = frame_of(inputs)
        self._device.apply(frame.updates)
        self._frame = frame

    def execute(self) -> None:
        frame, device = self._frame, self._device
        if isinstance(frame, PrefillFrame):
            assert len(frame.tokens) <= self._shape.token_capacity
            row = device.rows[frame.row]
            assert row.position == frame.start_position, "prefill at the wrong position"
            for token in frame.tokens:
                device.write(row, token)
            device.prompt_tokens_run += len(frame.tokens)
            samples = (device.sample(frame.row),) if frame.ends_prompt else ()
            self._result = StepResult(samples=samples)
        elif isinstance(frame, DecodeFrame):
            assert len(frame.rows) <= self._shape.batch_capacity
            samples = []
            for row_id in frame.rows:
                row = device.rows[row_id]
                device.write(row, row.pending)
                samples.append(device.sample(row_id))
            self._result = StepResult(samples=tuple(samples))
        elif isinstance(frame, MixedFrame):
            assert len(frame.rows) <= self._shape.batch_capacity
            assert len(frame.prompt_tokens) <= self._shape.prefill_capacity
            samples = []
            for index, row_id in enumerate(frame.rows):
                row = device.rows[row_id]
                if index == frame.prefill_row:
                    assert row.position == frame.prompt_start, "prompt at the wrong position"
                    for token in frame.prompt_tokens:
                        device.write(row, token)
                    device.prompt_tokens_run += len(frame.prompt_tokens)
                    if not frame.prompt_ends:
                        continue
                else:
                    device.write(row, row.pending)
                samples.append(device.sample(row_id))
            self._result = StepResult(samples=tuple(samples))
        elif isinstance(frame, StateOpFrame):
            assert self._shape.state_op is StateOp.SNAPSHOT, "toy runs only snapshots"
            assert len(frame.copies) <= self._shape.batch_capacity
            for copy in frame.copies:
                self._copy_row(copy.src_row, copy.dst_row, copy.dst_page)
            self._state_lanes = len(frame.copies)
        else:
            raise TypeError(f"toy programs do not run {type(frame).__name__}")

    def _copy_row(self, src_id: int, dst_id: int, dst_page: int) -> None:
        """Like ``gpu.programs.state_ops``: full pages shared, partial page copied."""
        device = self._device
        src = device.rows[src_id]
        full = src.position // device.page_size
        blocks = list(src.blocks[:full])
        if src.position % device.page_size and dst_page >= 0:
            device.kv[dst_page] = dict(device.kv.get(src.blocks[full], {}))
            blocks.append(dst_page)
        device.rows[dst_id] = _Row(position=src.position, pending=src.pending, blocks=blocks)
        device.snapshots.append((src_id, src.position, dst_page))

    def read_outputs(self) -> dict[str, Any]:
        if isinstance(self._frame, StateOpFrame):
            return {RESULT_KEY: StateOpResult(lanes=self._state_lanes)}
        return {RESULT_KEY: self._result}


SNAPSHOT_SHAPE = GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0,
                            state_op=StateOp.SNAPSHOT)


def toy_catalog(max_batch: int = 4, prefill: Sequence[int] = (64,), *,
                mixed: bool = False, snapshots: bool = False) -> tuple[GraphShape, ...]:
    mixed_shapes = [GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                               prefill_capacity=c, packed_capacity=c + b - 1)
                    for b in (2, 4) if b <= max_batch for c in prefill] if mixed else []
    decode = [GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                         packed_capacity=b)
              for b in (1, 2, 4, 8, 16) if b <= max_batch]
    prefills = [GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)
                for c in prefill]
    state = [SNAPSHOT_SHAPE] if snapshots else []
    return (*decode, *prefills, *mixed_shapes, *state)


def toy_durations(shape: GraphShape) -> int:
    """Device time per shape: prefill 4 ms per 64 tokens, decode 1 ms + 0.25 ms/row,
    a state operation 0.2 ms."""
    if shape.kind is GraphKind.STATE:
        return 200_000
    if shape.kind is GraphKind.PREFILL:
        return 4_000_000 * shape.token_capacity // 64
    if shape.kind is GraphKind.MIXED:
        return 4_000_000 * shape.prefill_capacity // 64 + 250_000 * shape.batch_capacity
    return 1_000_000 + 250_000 * shape.batch_capacity


@dataclass(slots=True)
class ToySystem:
    runtime: Runtime
    backend: FakeBackend
    device: ToyDevice


@contextlib.asynccontextmanager
async def toy_runtime(
    *, page_size: int = 4, num_pages: int = 64, state_rows: int = 4, max_queue: int = 8,
    max_context: int = 256, auto_complete: bool = True, max_batch: int = 4,
    prefill: Sequence[int] = (64,), timed: bool = False, mixed: bool = False,
    snapshots: bool = False, scheduler_policy: str = "balanced", decode_prompt_tail: bool = True,
    admission_order: str = "fifo",
) -> AsyncIterator[ToySystem]:
    """``timed``: launches take their ``toy_durations`` in virtual time (a driver task
    completes them in FIFO order), so concurrency looks like a real device;
    ``decode_prompt_tail``: ``RuntimeConfig.decode_prompt_tail``."""
    clock = lambda: int(trio.current_time() * 1e9)  # noqa: E731
    backend = FakeBackend(device_ns=toy_durations, auto_complete=auto_complete and not timed,
                          clock_ns=clock)
    device = ToyDevice(page_size=page_size)
    catalog = toy_catalog(max_batch, prefill, mixed=mixed, snapshots=snapshots)
    programs = {shape: ToyProgram(shape, device) for shape in catalog}
    backend.prepare(list(programs.values()))
    codec: TextCodec = ToyCodec()
    parts = RuntimeParts(
        backend=backend, programs=programs, codec=codec, model_name="toy", vocab_size=VOCAB,
        eos_token_ids=(EOS,), max_context=max_context, page_size=page_size,
        num_pages=num_pages, state_rows=state_rows, max_queue=max_queue,
        policy=PolicyConfig(), clock_ns=clock, scheduler_policy=scheduler_policy,
        decode_prompt_tail=decode_prompt_tail, admission_order=admission_order,
    )
    with trio.fail_after(TOY_DEADLINE_S):
        async with (open_runtime_with(parts, catalog=catalog) as runtime,
                    _maybe_driven(backend, timed)):
            yield ToySystem(runtime=runtime, backend=backend, device=device)


@contextlib.asynccontextmanager
async def _maybe_driven(backend: FakeBackend, timed: bool) -> AsyncIterator[None]:
    if not timed:
        yield
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, backend)
        yield
        nursery.cancel_scope.cancel()


async def drive(backend: FakeBackend) -> None:
    """A virtual-time device: each launch completes after its scripted duration."""
    while True:
        await until(lambda: bool(backend.pending()), limit=10**9)
        await trio.sleep(toy_durations(backend.pending()[0].shape) / 1e9)
        backend.complete_next()


async def collect(rt: Runtime, req: GenerationRequest) -> tuple[list[int], Finished]:
    """Run ``req`` to its end: its output token ids and its ``Finished``."""
    tokens: list[int] = []
    final: Finished | None = None
    async with rt.generate(req) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                final = event
    assert final is not None
    return tokens, final


def request(prompt: Sequence[int], max_tokens: int, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=max_tokens, **kw)


async def until(condition: Callable[[], bool], *, limit: int = 10_000) -> None:
    """Wait (in virtual time) until ``condition()`` holds; fail after ``limit`` polls."""
    for _ in range(limit):
        if condition():
            return
        await trio.sleep(0.0001)
    raise AssertionError("condition never became true")


async def wait_until_idle(rt: Runtime) -> None:
    """Wait until every request released its resources (the book reports the moment
    its last resident leaves); fail after 10 s."""
    book = rt.resources
    if not book.statistics().residents:
        return
    idle = trio.Event()
    book.emptied.append(idle.set)
    try:
        with trio.fail_after(10):
            await idle.wait()
    finally:
        book.emptied.remove(idle.set)
