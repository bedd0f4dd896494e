"""ModelEngine: load a checkpoint and build every prepared program of a catalog.

Owns the wiring of one served model on one device: configuration, tokenizer,
weights, decoder, the paged KV cache, device request state, one workspace sized to
the largest shape of the catalog (MIX-38 (3)), and one prepared program per
``GraphShape``. Capture and launch belong to the backends (``gpu.backends``).
Execution options (``gpu.programs.execution``) default by device: static, capturable
programs on CUDA; programs whose attention reads only the context the frame needs on
the CPU.
A speculative load (``speculation_source``) adds the complete speculative programs
through ``gpu.programs.speculative_attach.attach_speculation`` after the ordinary ones.
The parts the programs share live in ``gpu.engine_parts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu.engine_parts import EngineParts, UnsupportedShapeError
from gpu.frames import TOP_LOGPROBS
from gpu.grammar_rows import ResidentGrammars
from gpu.model.config import ModelConfig
from gpu.model.decoder import Decoder
from gpu.model.dtypes import resolve_dtype
from gpu.model.kv_cache import CacheGeometry, PagedKVCache
from gpu.model.sharding import ShardError, check_shardable
from gpu.model.tokenizer import Tokenizer
from gpu.model.vision import VisionTower
from gpu.model.vision_config import load_served_config
from gpu.model.vision_weights import load_served_weights, served_source
from gpu.program import PreparedProgram
from gpu.programs.execution import ExecutionOptions
from gpu.programs.speculative_attach import attach_speculation, is_speculative_shape
from gpu.programs.state_ops import StateOpProgram
from gpu.programs.step import StepProgram
from gpu.programs.vision import DEFAULT_STORED_IMAGES, VisionProgram
from gpu.programs.workspace import Workspace
from gpu.request_state import RequestState
from gpu.speculative.copy_proposals import COPY_MAX_NGRAM
from policy.descriptors import GraphKind, GraphShape

__all__ = [
    "COPY_MAX_NGRAM",
    "ExecutionOptions",
    "ModelEngine",
    "ShardError",
    "check_shardable",
    "load_speculative_engine",
    "resolve_dtype",
]

class ModelEngine:
    """A loaded model with its prepared programs, keyed by shape."""

    def __init__(
        self,
        *,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        parts: EngineParts,
        programs: dict[GraphShape, PreparedProgram],
        device: str,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.parts = parts
        self.programs = programs
        self.device = device
        self.dtype = dtype
        self.vision: VisionTower | None = None
        """The image encoder of a vision-language checkpoint (None: text only)."""

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise FileNotFoundError("this checkpoint has no tokenizer.json")
        return self._tokenizer

    @property
    def geometry(self) -> CacheGeometry:
        return self.parts.cache.geometry

    @property
    def execution(self) -> ExecutionOptions:
        """How this engine's step programs bound their work."""
        return self.parts.execution

    @property
    def state_rows(self) -> int:
        return self.parts.state.rows

    def hold_grammars(self, backend: object) -> bool:
        """Give the request state resident grammar matchers (``gpu.grammar_rows``) when
        ``backend`` declares ``resident_grammars`` (a stream that binds each frame
        after the frame ahead executed, on the host's CPU) and the checkpoint has a
        tokenizer; call before ``prepare``. True when the programs now hold them."""
        if not getattr(backend, "resident_grammars", False) or self._tokenizer is None:
            return False
        self.parts.state.grammars = ResidentGrammars(
            self._tokenizer.to_json(), vocab_size=self.config.vocab_size,
            eos_token_ids=self._tokenizer.eos_token_ids)
        return True

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str,
        dtype: torch.dtype | str | None,
        catalog: Sequence[GraphShape],
        page_size: int,
        num_pages: int,
        state_rows: int,
        max_context: int | None = None,
        require_tokenizer: bool = True,
        execution: ExecutionOptions | None = None,
        speculation_source: str | None = None,
        draft_model_dir: str | Path | None = None,
        draft_catch_up: int = 0,
        vision_feature_images: int = DEFAULT_STORED_IMAGES,
        hold_model: bool = True,
    ) -> ModelEngine:
        """Load ``model_dir`` onto ``device`` and prepare one program per catalog shape.

        ``max_context`` (default: the model's ``max_position_embeddings``, capped by the
        page pool) bounds positions and the per-row block table. ``execution`` defaults
        to ``ExecutionOptions.for_device(device)``; host-chosen bounds are refused on
        CUDA, where ``execute`` is captured once and replayed.

        Speculative shapes (``SPECULATIVE`` and ``speculation_enabled`` mixed) need
        ``speculation_source`` (``"draft"`` with ``draft_model_dir``, or ``"copy"``):
        the ordinary shapes are built first, then ``attach_speculation`` adds the
        speculative programs and wraps the ordinary ones to keep the draft context
        (``draft_catch_up > 0``: let it lag behind decodes, ``gpu.draft_state``).

        ``hold_model=False``: the decoders' weights and the KV pools are placeholders
        (``meta`` tensors: shapes, no memory) for the ranks of a tensor-parallel group,
        each of which reads its own shard from the checkpoint
        (``gpu.backends.rank_programs``).
        """
        execution = execution or ExecutionOptions.for_device(device)
        if (execution.host_bounds or execution.capture_forward) and \
                torch.device(device).type == "cuda":
            raise ValueError("host-chosen execution bounds and forward capture cannot be "
                             "captured into a CUDA graph: use ExecutionOptions.static() "
                             "on CUDA")
        directory = Path(model_dir)
        config, vision_config = load_served_config(directory)
        serving_dtype = resolve_dtype(device, dtype, config.torch_dtype)
        tokenizer: Tokenizer | None = None
        if (directory / "tokenizer.json").exists():
            tokenizer = Tokenizer.load(directory, extra_eos_ids=config.eos_token_ids)
        elif require_tokenizer:
            raise FileNotFoundError(f"tokenizer.json not found in {directory}")
        context = min(max_context or config.max_context, config.max_context,
                      num_pages * page_size)
        geometry = CacheGeometry(page_size=page_size, num_pages=num_pages, max_context=context)
        model_device = device if hold_model else "meta"
        weights, vision = load_served_weights(directory, config, vision_config, device=device,
                                              dtype=serving_dtype, text_device=model_device)
        decoder = Decoder(config, weights, max_context=context, device=device,
                          dtype=serving_dtype)
        decoder.source = served_source(directory, vision_config)
        if execution.capture_forward:
            decoder.enable_capture()
        cache = PagedKVCache(config, geometry, device=model_device, dtype=serving_dtype)
        state = RequestState(state_rows, geometry, vocab_size=config.vocab_size,
                             device=device)
        state.page_pools.append(cache)
        shapes = list(dict.fromkeys(catalog))
        token_shapes = [s for s in shapes if s.kind not in (GraphKind.STATE, GraphKind.VISION)]
        max_tokens = max([s.max_packed_extent for s in token_shapes], default=1)
        max_lanes = max([s.batch_capacity for s in shapes if s.kind is not GraphKind.VISION],
                        default=1)
        workspace = Workspace(max_tokens=max_tokens, max_lanes=max_lanes, device=device,
                              sink_row=state.sink_row, sink_page=geometry.sink_page,
                              top_width=min(TOP_LOGPROBS, config.vocab_size))
        parts = EngineParts(decoder=decoder, cache=cache, state=state, workspace=workspace,
                            execution=execution,
                            vision=None if vision is None else VisionProgram(
                                vision, stored_images=vision_feature_images))
        speculative = [s for s in shapes if is_speculative_shape(s)]
        if speculative and speculation_source is None:
            raise UnsupportedShapeError(
                f"{speculative[0].label()}: speculative shapes need a speculation_source")
        programs = {shape: build_program(shape, parts) for shape in shapes
                    if not is_speculative_shape(shape)}
        engine = cls(config=config, tokenizer=tokenizer, parts=parts, programs=programs,
                     device=device, dtype=serving_dtype)
        engine.vision = vision
        if speculation_source is not None:
            attach_speculation(engine, speculative, source=speculation_source,
                               draft_model_dir=draft_model_dir, draft_catch_up=draft_catch_up)
        return engine


def load_speculative_engine(
    model_dir: str | Path, *, catalog: Sequence[GraphShape], source: str,
    draft_model_dir: str | Path | None = None, copy_max_ngram: int = COPY_MAX_NGRAM,
    draft_catch_up: int = 0, **load_options: Any,
) -> ModelEngine:
    """``ModelEngine.load`` for a speculative load: the ordinary shapes of ``catalog``
    through the engine, then every speculative and ``speculation_enabled`` mixed shape
    through ``attach_speculation`` (``load_options`` go to ``ModelEngine.load``)."""
    ordinary = [s for s in catalog if not is_speculative_shape(s)]
    engine = ModelEngine.load(model_dir, catalog=ordinary, **load_options)
    attach_speculation(engine, [s for s in catalog if is_speculative_shape(s)], source=source,
                       draft_model_dir=draft_model_dir, copy_max_ngram=copy_max_ngram,
                       draft_catch_up=draft_catch_up)
    return engine


def build_program(shape: GraphShape, parts: EngineParts) -> PreparedProgram:
    """The prepared program for one shape, bound to views of the shared workspace."""
    kind = shape.kind
    if kind is GraphKind.STATE:
        return StateOpProgram(shape, cache=parts.cache, state=parts.state,
                              workspace=parts.workspace)
    if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.DECODE):
        return StepProgram(shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                           workspace=parts.workspace, execution=parts.execution,
                           vision=parts.vision)
    if kind is GraphKind.MIXED:
        if shape.token_capacity != 1 or shape.speculation_enabled:
            raise UnsupportedShapeError(
                f"{shape.label()}: an ordinary mixed program runs decode width 1 without draft "
                "state (wider or speculating mixed programs load with the speculative engine)"
            )
        return StepProgram(shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                           workspace=parts.workspace, execution=parts.execution,
                           vision=parts.vision)
    if kind is GraphKind.VISION and parts.vision is not None:
        # one per image bucket, sharing the tower and the feature storage
        return parts.vision.with_images(shape.batch_capacity)
    raise UnsupportedShapeError(f"{shape.label()}: {kind.value} programs are not built yet")
