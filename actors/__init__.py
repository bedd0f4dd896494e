"""flare's runtime: trio actors that turn scheduler plans into executed frames and
frames into published tokens. ``system.py`` is the one place that opens channels.

This face is what ``app`` uses: the runtime's public surface (``actors.public``) and
its error family (``actors.errors``). It loads neither torch nor the scheduler;
``actors.system.open_runtime`` and ``actors.config.RuntimeConfig`` are imported from
their modules by whoever opens a runtime.
"""

from actors.errors import (
    AdmissionError,
    ContextTooLong,
    FlareRuntimeError,
    GenerationFailed,
    InvalidRequest,
    QueueFull,
    RuntimeShutDown,
)
from actors.grammar import grammar_problem
from actors.public import (
    MAX_LOGIT_BIAS_ENTRIES,
    TOP_LOGPROBS,
    Alternatives,
    Finished,
    FinishReason,
    GenerationRequest,
    GrammarKind,
    GrammarSpec,
    ImagePrompting,
    ImageSpan,
    PromptScores,
    Runtime,
    RuntimeStatistics,
    SamplingParams,
    StreamEvent,
    TextCodec,
    TokenDelta,
    context_room,
    fits_context,
)

__all__ = [
    "MAX_LOGIT_BIAS_ENTRIES",
    "TOP_LOGPROBS",
    "AdmissionError",
    "Alternatives",
    "ContextTooLong",
    "FinishReason",
    "Finished",
    "FlareRuntimeError",
    "GenerationFailed",
    "GenerationRequest",
    "GrammarKind",
    "GrammarSpec",
    "ImagePrompting",
    "ImageSpan",
    "InvalidRequest",
    "PromptScores",
    "QueueFull",
    "Runtime",
    "RuntimeShutDown",
    "RuntimeStatistics",
    "SamplingParams",
    "StreamEvent",
    "TextCodec",
    "TokenDelta",
    "context_room",
    "fits_context",
    "grammar_problem",
]
