"""Runtime configuration: everything ``open_runtime`` needs, as one frozen value.

``ops/run_command.py`` builds it from ``flare run`` flags; tests build it directly.
Validation of individual values happens here (``RuntimeConfig.validate``) so that the
CLI can stop with a clear message before anything loads.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Literal

from policy import (
    DEFAULT_WINDOW_IMAGES,
    FIXED_SPEC_POLICIES,
    PRESET_POLICIES,
    RUNTIME_POLICIES,
    GraphKind,
    GraphShape,
    check_admission_order,
)

DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "models" / "default"
DEFAULT_DRAFT_DIR = pathlib.Path(__file__).resolve().parents[1] / "models" / "default-draft"

BackendName = Literal["cpu", "cuda"]
SpeculationSetting = Literal["off", "fixed", "adaptive"]
"""``--speculation``: ``off``, or the value of a ``policy.rounds.SpeculationMode``."""
DraftSource = Literal["draft", "copy"]
SpeculativeAllocation = Literal["host", "device"]
DtypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("raw_logprobs", "processed_logprobs")
DTYPE_CHOICES: tuple[DtypeSetting, ...] = ("auto", "float32", "bfloat16", "float16")
"""``--dtype``: ``auto`` serves the checkpoint's declared dtype where the backend runs it
(``gpu.model.dtypes``)."""
DEFAULT_DRAFT_DEPTH = 4
"""Proposal depth D of a speculative load: widths 1..D+1 are prepared (SPEC-12)."""
DEFAULT_DRAFT_CATCH_UP = 0
"""Most missed positions a learned round re-feeds a lagging draft (``--draft-catch-up``);
0, the default, keeps the seed's maintained draft context (docs/speculative-programs.md:
with a lagging draft, adaptive selection at one stream decodes from the
start and never learns acceptance, because a round then looks 1.7x dearer than a decode
against the 0.5^d prior and the 1 % probe ledger funds no probe within a request)."""
DEFAULT_PREFILL_CAPACITIES = (64, 256, 1024)
MAX_BATCH_LIMIT = 64
"""The most request slots a program has (``policy.descriptors.MAX_REQUEST_SLOTS``)."""
DEFAULT_MAX_BATCH = 16
"""``--max-batch``: on the embedded model a decode step costs less per token the more
lanes it packs (``flare bench forward``, docs/benchmarks-programs.md: 1.4-1.8x the
tokens/s at 16 lanes against 8), and a power-of-two B keeps 2B requests resident, so 16 serves a
16-stream load in one batch and keeps a 32-stream load out of the queue; decode[32]
was no faster per token than decode[16] (0.7-1.1x) and costs another prepared bucket."""
CPU_COST_DRIFT_WEIGHT = 0.1
"""``--cost-drift-weight``'s default on the cpu backend (``policy/cost_drift.py``): the
CPU's speed drifts with the host's other work, so one speed factor moves every
estimate; 0.1 follows a change within about ten frames."""
SCHEDULER_POLICIES = RUNTIME_POLICIES
"""``--scheduler-policy`` (the names live in ``policy.baselines.factory``)."""


class ConfigError(ValueError):
    """Raised when a runtime configuration value is invalid; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    model_dir: pathlib.Path = DEFAULT_MODEL_DIR
    draft_model_dir: pathlib.Path | None = None
    backend: BackendName = "cpu"
    dtype: DtypeSetting = "auto"
    """``--dtype``: the serving dtype; ``auto`` is the checkpoint's (``torch_dtype``) where
    the backend runs it, else float32 on the CPU and bfloat16 on CUDA."""
    max_batch: int = DEFAULT_MAX_BATCH
    """Most requests in one decode batch (1..64, any integer): the prepared decode
    buckets are the powers of two up to it, rounded up (``catalog_setup``)."""
    prefill_capacities: tuple[int, ...] = DEFAULT_PREFILL_CAPACITIES
    mixed_prefill: bool = False
    speculative_mixed: bool = True
    """``--no-speculative-mixed`` sets it False: an adaptive speculative load with mixed
    programs prepares only the width-one ones, so a frame carrying a prompt chunk
    verifies no drafts (``gpu.catalog.CatalogFlags.speculative_mixed``; flare's opt-in
    departure from MIX-41/MIX-43)."""
    speculation: SpeculationSetting = "off"
    speculative_token_capacity: int = 0
    """``--speculative-token-capacity R``: bound on aggregate target rows (0 = B*W)."""
    draft_source: DraftSource = "draft"
    """``--draft-source``: proposals from the learned draft model (``draft``, needs
    ``draft_model_dir``) or copied from the request's own token history (``copy``)."""
    draft_depth: int = DEFAULT_DRAFT_DEPTH
    """``--draft-depth D``: proposal depth of a speculative load (1..7)."""
    draft_catch_up: int = DEFAULT_DRAFT_CATCH_UP
    """``--draft-catch-up K``: a learned draft's context may lag behind ordinary decodes
    (they skip the draft forward) and catches up, at most K missed positions, inside the
    next learned round (``gpu.draft_state``; flare's extension of SPEC-5). 0 keeps the
    seed's rule: every width-one step feeds the draft."""
    draft_counterfactuals: bool = True
    """Adaptive learned speculation: a width-one step that keeps the draft context
    reports the draft's greedy proposal for the token it emits, and for greedy requests
    the match is a depth-one acceptance observation (flare's extension of ACC-9 for the
    learned source). False keeps the seed's rule (``flare run
    --no-draft-counterfactuals``)."""
    copy_counterfactuals: bool = True
    """Adaptive copy speculation: frames that verify no copy drafts (decodes, width-one
    rounds) still teach copy acceptance, from the drafts the host replays the lookup
    for (``actors.copy_counterfactuals``; flare's extension of ACC-9 for the copy
    source). False keeps the seed's rule that only verified rounds observe
    (``flare run --no-copy-counterfactuals``)."""
    speculative_allocation: SpeculativeAllocation = "host"
    """``--speculative-allocation``: ``host`` prepares host-allocated (``QueryLength``)
    speculative programs only; ``device`` adds ragged device-allocated
    (``SpeculativePrefixLimit``) ones (``gpu.catalog.device_allocated_shapes``), which
    only adaptive selection runs (SPEC-17)."""
    extra_speculative_shapes: tuple[GraphShape, ...] = ()
    """Speculative programs to prepare beside the generated catalog (for instance
    ragged or device-allocated ``SpeculativePrefixLimit`` ones, which ``gpu.catalog``
    does not generate); adaptive mode only, proposal depth at most ``draft_depth``."""
    max_context: int | None = None
    """Defaults to the model's ``max_position_embeddings``."""
    page_size: int = 16
    kv_pages: int | None = None
    """Pages in the KV pool; default: enough for ``max_batch`` full contexts."""
    vision_feature_images: int = DEFAULT_WINDOW_IMAGES
    """``--vision-feature-images``: images whose encoded features the vision feature
    storage keeps (vision-language checkpoints; ``gpu.programs.vision``)."""
    max_queue: int = 64
    """Bounded admission queue: requests waiting beyond the resident ones."""
    admission_order: str = "fifo"
    """``--admission-order``: which waiting request gets the next free row, ``fifo`` or
    ``least-slack`` (``policy.admission_order``)."""
    prefix_caching: bool = True
    """Reuse cached KV pages of shared prompt prefixes; False computes every prompt in
    full (``--no-enable-prefix-caching``)."""
    decode_prompt_tail: bool = True
    """A request whose uncached prompt is one token (a whole prompt found in the prefix
    cache, or a one-token prompt) feeds it to its first decode step instead of a
    prompt chunk (``policy.lifecycle.decodes_prompt_tail``); False: the seed's prefill
    (``--no-decode-prompt-tail``)."""
    gpu_memory_utilization: float | None = None
    """vLLM's ``--gpu-memory-utilization``: accepted and checked, not yet used to size
    the KV pool (``actors.context_sizing`` logs that it is ignored)."""
    state_operations: bool = False
    """Prepare state-operation programs (measured at start-up), so a normal completion
    whose checkpoint allowance pays for it ends with a scheduled terminal SNAPSHOT
    capture (PRE-38..53, QUEUE-20..23). Off by default: on a pure-attention model the
    terminal checkpoint is a host-side page move with the same reuse, and a capture
    costs a window-draining frame per completion and delays the conversation's next
    turn until it ran (docs/runtime.md, *Checkpoints*, measured figures)."""
    device_process: bool = True
    """CPU backend: run the prepared programs in a device process of their own
    (``gpu.backends.cpu_process``); False keeps them on a worker thread of the serving
    process (``flare run --no-device-process``, A/B benchmarks)."""
    tensor_parallel_size: int = 1
    """vLLM's ``--tensor-parallel-size`` (``-tp``): CPU backend, run every frame on that
    many ranks, a device process each holding a shard of the model and of the KV pool
    (``gpu.backends.tensor_parallel``, docs/tensor-parallel.md)."""
    nnodes: int = 1
    """torchrun's ``--nnodes``: machines the tensor-parallel group spans; this one
    serves with the first ``tensor_parallel_size / nnodes`` ranks, the others run
    ``flare rank`` and meet at ``MASTER_ADDR``/``MASTER_PORT``."""
    resident_grammars: bool = True
    """Hold constrained requests' grammar matchers with the programs where the backend's
    stream allows it (the ``cpu`` backend; ``gpu.grammar_rows``), so their frames need
    no completion feedback; False keeps every grammar on the host, each constrained
    frame waiting for the previous token (``flare run --host-grammars``, A/B benchmarks).
    The cuda backend always keeps host grammars."""
    capture_forward: bool = True
    """CPU backend: replay each decoder forward shape from a graph traced on first use
    (``gpu.model.capture``; runs without the interpreter lock, so host planning and
    publication overlap execution). False runs the forward op by op (A/B benchmarks)."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """vLLM's ``--logprobs-mode``: ``raw_logprobs`` reports the model's raw
    distribution; ``processed_logprobs`` the one each token was drawn from (after the
    grammar mask, logit processing, temperature and the top-k/top-p/min-p filters;
    ``gpu.sampling.processed_log_probs``). Scored prompt tokens are raw in both."""
    scheduler_policy: str = "balanced"
    """The seed's presets, or a baseline policy on the same prepared programs
    (``fixed-spec-K`` needs a speculative load of draft depth at least K)."""
    scheduler_terminal_value: float | None = None
    scheduler_terminal_age_price: float | None = None
    adaptive_verification_alpha: float | None = None
    cost_drift_weight: float | None = None
    """``--cost-drift-weight``: ``PolicyConfig.cost_drift_weight`` (``policy/cost_drift.py``);
    None takes the backend's (``CPU_COST_DRIFT_WEIGHT`` on cpu, 0, the seed's, on cuda)."""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def effective_cost_drift_weight(self) -> float:
        """The shared speed factor's weight in force: the flag, else the backend's."""
        if self.cost_drift_weight is not None:
            return self.cost_drift_weight
        return CPU_COST_DRIFT_WEIGHT if self.backend == "cpu" else 0.0

    @property
    def tensor_parallel_options(self) -> dict[str, int]:
        """The cpu backend's options for the tensor-parallel group (``open_backend``)."""
        return {"tensor_parallel": self.tensor_parallel_size, "nnodes": self.nnodes}

    def validate(self) -> None:
        """Raise ``ConfigError`` with a message naming the first invalid value."""
        if not 1 <= self.vision_feature_images <= 1024:
            raise ConfigError("--vision-feature-images must be 1..1024, got "
                              f"{self.vision_feature_images}")
        if not 1 <= self.max_batch <= MAX_BATCH_LIMIT:
            raise ConfigError(f"--max-batch (--max-num-seqs) must be 1..{MAX_BATCH_LIMIT}, "
                              f"got {self.max_batch}")
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                              f"got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, "
                              f"got {self.logprobs_mode!r}")
        if self.backend == "cuda" and self.dtype == "float32":
            # gpu.model.dtypes: CUDA programs run bfloat16 or float16
            raise ConfigError("--dtype float32 is not supported on the cuda backend; it runs "
                              "bfloat16 or float16 (or --dtype auto)")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be >= 1, "
                              f"got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.backend != "cpu" or not self.device_process):
            raise ConfigError("--tensor-parallel-size above 1 runs on the cpu backend's "
                              "device processes (not with --no-device-process or cuda)")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes or (
                self.nnodes > 1 and self.tensor_parallel_size == 1):
            raise ConfigError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size "
                              f"{self.tensor_parallel_size} (above 1) evenly")
        if not self.prefill_capacities:
            raise ConfigError("--prefill-capacity needs at least one capacity")
        for c in self.prefill_capacities:
            if c <= 0 or c % 64:
                raise ConfigError(f"--prefill-capacity values must be positive multiples of 64, got {c}")
        if self.speculative_token_capacity < 0:
            raise ConfigError("--speculative-token-capacity must be non-negative")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"--max-context must be positive, got {self.max_context}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ConfigError(f"--kv-pages must be positive, got {self.kv_pages}")
        share = self.gpu_memory_utilization
        if share is not None and not (math.isfinite(share) and 0 < share <= 1):
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
        if self.scheduler_policy not in SCHEDULER_POLICIES:
            raise ConfigError(f"--scheduler-policy must be one of {', '.join(SCHEDULER_POLICIES)}, "
                              f"got {self.scheduler_policy!r}")
        if self.max_queue < 1:
            raise ConfigError("max_queue must be at least 1")
        try:
            check_admission_order(self.admission_order)
        except ValueError as exc:
            raise ConfigError(f"--admission-order: {exc}") from None
        if self.page_size < 1:
            raise ConfigError("page_size must be positive")
        for name in ("scheduler_terminal_value", "scheduler_terminal_age_price"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be finite and non-negative, got {value}")
        drift = self.cost_drift_weight
        if drift is not None and not 0 <= drift <= 1:  # also refuses NaN
            raise ConfigError(f"--cost-drift-weight must be between 0 and 1, got {drift}")
        alpha = self.adaptive_verification_alpha
        if alpha is not None and (not math.isfinite(alpha) or alpha <= 0):
            raise ConfigError(f"--mtp-adaptive-verification-alpha must be finite and > 0, got {alpha}")
        if not self.model_dir.is_dir():
            raise ConfigError(f"--model: no such directory: {self.model_dir}")
        if self.draft_model_dir is not None and not self.draft_model_dir.is_dir():
            raise ConfigError(f"--draft-model: no such directory: {self.draft_model_dir}")
        if self.speculation == "off" and self.extra_speculative_shapes:
            raise ConfigError("extra speculative shapes need --speculation adaptive")
        if self.speculation not in ("off", "fixed", "adaptive"):
            raise ConfigError(f"--speculation must be off, fixed or adaptive, got "
                              f"{self.speculation!r}")
        if self.scheduler_policy in FIXED_SPEC_POLICIES:
            depth = FIXED_SPEC_POLICIES.index(self.scheduler_policy) + 1
            if self.speculation == "off":
                raise ConfigError(f"--scheduler-policy {self.scheduler_policy} needs a "
                                  "speculative load (--draft-model or --draft-source copy)")
            if depth > self.draft_depth:
                raise ConfigError(f"--scheduler-policy {self.scheduler_policy} needs "
                                  f"--draft-depth {depth} or more, got {self.draft_depth}")
        if not self.speculative_mixed and (self.speculation != "adaptive"
                                           or not self.mixed_prefill):
            raise ConfigError("--no-speculative-mixed needs --speculation adaptive and "
                              "--mixed-prefill (it drops that load's wider mixed programs)")
        if self.speculation != "off":
            if self.draft_source not in ("draft", "copy"):
                raise ConfigError(f"--draft-source must be draft or copy, got "
                                  f"{self.draft_source!r}")
            if self.draft_source == "draft" and self.draft_model_dir is None:
                raise ConfigError(f"--speculation {self.speculation} with --draft-source draft "
                                  "needs --draft-model (or use --draft-source copy)")
            if not 0 <= self.draft_catch_up <= 256:
                raise ConfigError(f"--draft-catch-up must be 0..256, got {self.draft_catch_up}")
            if not 1 <= self.draft_depth <= 7:
                raise ConfigError(f"--draft-depth must be 1..7, got {self.draft_depth}")
            if self.speculative_allocation not in ("host", "device"):
                raise ConfigError("--speculative-allocation must be host or device, got "
                                  f"{self.speculative_allocation!r}")
            if self.speculative_allocation == "device" and self.speculation != "adaptive":
                raise ConfigError("--speculative-allocation device needs --speculation "
                                  "adaptive (device allocation requires adaptive selection)")
            for shape in self.extra_speculative_shapes:
                if shape.kind is not GraphKind.SPECULATIVE or \
                        shape.proposal_depth > self.draft_depth or self.speculation != "adaptive":
                    raise ConfigError(f"extra speculative shape {shape.label()}: adaptive "
                                      "mode, SPECULATIVE kind, depth <= --draft-depth only")
            if self.scheduler_policy not in (*PRESET_POLICIES, *FIXED_SPEC_POLICIES):
                raise ConfigError(f"--speculation {self.speculation} runs with the seed's "
                                  "scheduler only (--scheduler-policy balanced or "
                                  "throughput), or with a fixed-spec-K baseline")
