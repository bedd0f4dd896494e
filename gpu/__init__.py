"""flare's model and prepared programs.

Owns weight loading, the decoder, the paged KV cache and device-resident request
state, sampling, the catalog of prepared shapes, and the backends (``cpu``, ``cuda``)
that launch programs and time them. Imports ``policy`` for descriptor types only.

Layout: ``gpu.model`` (configuration, weights, tokenizer, decoder, KV cache),
``gpu.programs`` (the prepared programs), ``gpu.speculative`` (proposal and
verification kernels), ``gpu.backends`` (the protocol and its implementations),
``gpu.engine`` (one loaded model with its programs).

This face re-exports what the runtime hands the device and gets back (frames and
results, the catalog, the model's configuration and tokenizer, the program and backend
protocols) and loads no torch. ``gpu.engine`` is the face that loads a model
(``ModelEngine`` with its ``ExecutionOptions``) and loads torch.
"""

from gpu.backends import (
    Backend,
    BackendError,
    BackendUnavailable,
    Completion,
    LaunchHandle,
    ProgramFault,
    open_backend,
)
from gpu.backends.cuda_probe import device_memory
from gpu.catalog import (
    Catalog,
    CatalogError,
    CatalogFlags,
    ModelDims,
    build_catalog,
    fixed_width_shapes,
    plan_catalog,
    vision_shapes,
)
from gpu.frames import (
    FRAME_KEY,
    GREEDY,
    MAX_LOGIT_BIAS_ENTRIES,
    NO_PROMPT_ROW,
    PEER_OUTPUTS_KEY,
    TOP_LOGPROBS,
    Alternatives,
    DecodeFrame,
    Frame,
    FrameError,
    ImageSpan,
    LaneSample,
    MixedFrame,
    PageAppend,
    PageCopy,
    PrefillFrame,
    RowCopy,
    RowInit,
    SamplingParams,
    StateOpFrame,
    StateUpdate,
    StepResult,
    VisionFrame,
    as_inputs,
    result_of,
)
from gpu.model.config import ModelConfig, ModelLoadError, load_model_config
from gpu.model.tokenizer import Tokenizer
from gpu.model.vision_config import VisionConfig, load_served_config
from gpu.preparation import prepare_catalog
from gpu.program import PreparedProgram
from gpu.programs.speculative_frames import (
    SpeculativeFrame,
    SpeculativeLane,
    SpeculativeMixedFrame,
    SpeculativeMixedResult,
    SpeculativeResult,
    speculative_result_of,
)

__all__ = [
    "FRAME_KEY",
    "GREEDY",
    "MAX_LOGIT_BIAS_ENTRIES",
    "NO_PROMPT_ROW",
    "PEER_OUTPUTS_KEY",
    "TOP_LOGPROBS",
    "Alternatives",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Catalog",
    "CatalogError",
    "CatalogFlags",
    "Completion",
    "DecodeFrame",
    "Frame",
    "FrameError",
    "ImageSpan",
    "LaneSample",
    "LaunchHandle",
    "MixedFrame",
    "ModelConfig",
    "ModelDims",
    "ModelLoadError",
    "PageAppend",
    "PageCopy",
    "PrefillFrame",
    "PreparedProgram",
    "ProgramFault",
    "RowCopy",
    "RowInit",
    "SamplingParams",
    "SpeculativeFrame",
    "SpeculativeLane",
    "SpeculativeMixedFrame",
    "SpeculativeMixedResult",
    "SpeculativeResult",
    "StateOpFrame",
    "StateUpdate",
    "StepResult",
    "Tokenizer",
    "VisionConfig",
    "VisionFrame",
    "as_inputs",
    "build_catalog",
    "device_memory",
    "fixed_width_shapes",
    "load_model_config",
    "load_served_config",
    "open_backend",
    "plan_catalog",
    "prepare_catalog",
    "result_of",
    "speculative_result_of",
    "vision_shapes",
]
