"""A roofline cost model for ``flare sim``: a named public model on a named accelerator.

Each prepared shape runs for ``overhead + max(bytes / (bandwidth * memory_efficiency),
flops / (peak * compute_efficiency))``: one step reads every weight once and the KV
cache of every generating row, and does ``2 * parameters`` FLOPs per token it processes
(padding included: a fixed shape pays for its capacity) plus the attention FLOPs. A
decode step is memory-bound (its time grows slowly with the batch, through the KV
reads) until the tokens it processes reach the compute knee
``peak * compute_efficiency * weight_time / (2 * parameters)`` -- about 230 tokens for
Llama-3-8B on one H100 SXM -- so the first prompt tokens of a mixed frame ride nearly
free on the weight reads its decode rows pay for anyway, and past the knee a prompt
token costs ``2 * parameters / (peak * compute_efficiency)`` whatever the chunk.

A shape does not say how long its rows' contexts are, so every generating row is
priced as attending over ``context_tokens`` positions (a stated assumption, the mean
context of the simulated traffic); a prompt chunk attends over itself (causal, about
``C**2 / 2`` query-key pairs). A speculative round also runs its draft model ``D``
sequential decode steps over the same rows; a state operation copies one row's KV
cache (read and write). Figures and the published step times they are checked against
are in ``docs/simulator.md``, *Roofline*.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from ops.sim.costs import NS_PER_MS, CostTable, SyntheticCosts
from policy.descriptors import GraphKind, GraphShape


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """What one forward pass reads and computes (a dense decoder-only transformer)."""

    name: str
    parameters: float
    """Total parameters (embeddings included: the LM head multiplies by them)."""
    layers: int
    kv_heads: int
    head_dim: int
    query_heads: int
    bytes_per_parameter: float = 2.0
    """2 for bf16 weights, 1 for fp8."""
    kv_bytes_per_value: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_parameter

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of every layer for one position."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one token through every weight."""
        return 2 * self.parameters

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one query attending to one key: scores and weighted values."""
        return 4 * self.layers * self.query_heads * self.head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    name: str
    memory_bandwidth: float
    """Bytes per second (datasheet peak)."""
    peak_flops: float
    """Dense FLOPs per second at the weights' precision (datasheet peak)."""


LLAMA3_8B = ModelSpec(name="Llama-3-8B", parameters=8.03e9, layers=32, kv_heads=8,
                      head_dim=128, query_heads=32)
"""Meta Llama 3 8B (and 3.1 8B): 32 layers, 32 query and 8 KV heads of 128, bf16."""
LLAMA32_1B = ModelSpec(name="Llama-3.2-1B", parameters=1.24e9, layers=16, kv_heads=8,
                       head_dim=64, query_heads=32)
"""The draft of the speculative programs (same tokenizer as Llama 3)."""
H100_SXM = DeviceSpec(name="H100 SXM", memory_bandwidth=3.35e12, peak_flops=989e12)
"""HBM3 3.35 TB/s; 989 TFLOPS dense bf16 (1979 dense fp8)."""
H200_SXM = DeviceSpec(name="H200 SXM", memory_bandwidth=4.8e12, peak_flops=989e12)


@dataclass(frozen=True, slots=True, kw_only=True)
class RooflineCosts:
    """Roofline durations of every shape for ``model`` on ``device``."""

    model: ModelSpec = LLAMA3_8B
    device: DeviceSpec = H100_SXM
    draft: ModelSpec = LLAMA32_1B
    memory_efficiency: float = 0.8
    """Fraction of peak bandwidth a weight-streaming GEMV reaches."""
    compute_efficiency: float = 0.55
    """Fraction of peak FLOPs a large prefill GEMM reaches."""
    step_overhead_ms: float = 1.5
    """Per-step time neither term covers: launches, sampling, small kernels."""
    draft_step_overhead_ms: float = 0.3
    context_tokens: int = 1024
    """Positions every generating row attends over (module docstring)."""

    @property
    def name(self) -> str:
        return f"roofline {self.model.name} on {self.device.name}"

    def step_ms(self, model: ModelSpec, *, tokens: int, rows: int, pairs: float,
                overhead_ms: float) -> float:
        """One forward pass of ``tokens`` tokens, ``rows`` of them reading a context of
        ``context_tokens``, with ``pairs`` query-key pairs of attention."""
        d = self.device
        read = model.weight_bytes + rows * self.context_tokens * model.kv_bytes_per_token
        written = tokens * model.kv_bytes_per_token
        memory_s = (read + written) / (d.memory_bandwidth * self.memory_efficiency)
        flops = tokens * model.flops_per_token + pairs * model.attention_flops_per_pair
        compute_s = flops / (d.peak_flops * self.compute_efficiency)
        return overhead_ms + 1e3 * max(memory_s, compute_s)

    def target_ms(self, *, tokens: int, rows: int, prompt_tokens: int = 0) -> float:
        pairs = rows * self.context_tokens + prompt_tokens * (prompt_tokens + 1) / 2
        return self.step_ms(self.model, tokens=tokens + prompt_tokens, rows=rows,
                            pairs=pairs, overhead_ms=self.step_overhead_ms)

    def draft_ms(self, rows: int, depth: int) -> float:
        """``depth`` sequential draft decode steps over ``rows`` rows."""
        if depth <= 0:
            return 0.0
        one = self.step_ms(self.draft, tokens=rows, rows=rows,
                           pairs=rows * self.context_tokens,
                           overhead_ms=self.draft_step_overhead_ms)
        return depth * one

    def mean_ms(self, shape: GraphShape) -> float:
        k = shape.kind
        if k in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            return self.target_ms(tokens=0, rows=0, prompt_tokens=shape.token_capacity)
        if k is GraphKind.DECODE:
            return self.target_ms(tokens=shape.batch_capacity, rows=shape.batch_capacity)
        if k is GraphKind.MIXED:
            rows = shape.batch_capacity
            return (self.target_ms(tokens=rows * shape.token_capacity, rows=rows,
                                   prompt_tokens=shape.prefill_capacity)
                    + self.draft_ms(rows, shape.proposal_depth))
        if k is GraphKind.SPECULATIVE:
            rows = shape.batch_capacity
            return (self.target_ms(tokens=shape.max_packed_extent, rows=rows)
                    + self.draft_ms(rows, shape.proposal_depth))
        # state operations copy one row's cache: read it and write it
        copy = 2 * shape.batch_capacity * self.context_tokens * self.model.kv_bytes_per_token
        return self.step_overhead_ms / 3 + 1e3 * copy / (
            self.device.memory_bandwidth * self.memory_efficiency)

    def knee_tokens(self) -> float:
        """Tokens per step at which the weight reads stop hiding the compute."""
        d, m = self.device, self.model
        weight_s = m.weight_bytes / (d.memory_bandwidth * self.memory_efficiency)
        return weight_s * d.peak_flops * self.compute_efficiency / m.flops_per_token

    def table(self, catalog: Iterable[GraphShape]) -> CostTable:
        return CostTable({s: round(self.mean_ms(s) * NS_PER_MS) for s in catalog},
                         source=self.name)


ROOFLINE_MODELS: dict[str, RooflineCosts] = {
    "roofline-llama3-8b-h100": RooflineCosts(),
    "roofline-llama3-8b-h100-fp8": RooflineCosts(
        model=replace(LLAMA3_8B, name="Llama-3-8B fp8", bytes_per_parameter=1.0,
                      kv_bytes_per_value=1.0),
        device=replace(H100_SXM, peak_flops=1979e12)),
}
"""The named roofline models of ``flare sim --cost-model``."""

LINEAR_MODEL = "linear"
COST_MODELS = (LINEAR_MODEL, *ROOFLINE_MODELS)
"""Every name ``--cost-model`` accepts: the synthetic linear model and the rooflines."""


def named_cost_table(name: str, catalog: Iterable[GraphShape]) -> CostTable:
    """The table of the cost model called ``name`` (``ValueError`` when unknown)."""
    if name == LINEAR_MODEL:
        return SyntheticCosts().table(catalog)
    try:
        return ROOFLINE_MODELS[name].table(catalog)
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; expected one of: "
                         f"{', '.join(COST_MODELS)}") from None
