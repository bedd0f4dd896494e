"""Building blocks of complete speculative programs (seed: *Speculative graph coverage*,
*Completed confidence and acceptance*).

Standalone, capturable torch functions that a complete ``(B, D, W, P)`` program composes:
rejection-sampling verification and the survival sidecar (``verification``), sampling
distributions matching the ordinary sampler (``distributions``), keyed randomness
streams (``randomness``), the confidence sidecar (``confidence``, OPEN-16), device
allocation of target rows under ``SpeculativePrefixLimit`` (``allocation``), and copy
(n-gram) proposals (``copy_proposals``). See ``docs/speculation.md``.
"""

from gpu.speculative.allocation import (
    PackedLayout,
    allocate_target_rows,
    packed_layout,
    reference_allocation,
    unpack_lane_rows,
)
from gpu.speculative.confidence import (
    JOINT_PREFIX_PROBABILITY,
    POSITION_CONFIDENCE,
    SIDECAR_DTYPE,
    confidence_sidecar,
    copy_confidence,
    draft_confidence,
    sampled_token_probability,
    sidecar_shape,
    write_confidence_sidecar,
)
from gpu.speculative.copy_proposals import (
    CopyProposal,
    append_context,
    propose_copy,
    reference_copy_proposal,
)
from gpu.speculative.distributions import (
    acceptance_probability,
    filtered_probs,
    filtered_probs_by_lane,
    greedy_tokens,
    processed_log_probs_by_lane,
)
from gpu.speculative.randomness import (
    acceptance_uniforms,
    sample_draft_tokens,
    sample_from_probs,
    stream_seed,
)
from gpu.speculative.verification import (
    PAD_TOKEN,
    SURVIVAL_OUTPUT,
    Verification,
    emitted_logprobs,
    pick_logprobs,
    speculative_survival,
    target_log_probs,
    verify_drafts,
    verify_greedy,
)

__all__ = [
    "JOINT_PREFIX_PROBABILITY",
    "PAD_TOKEN",
    "POSITION_CONFIDENCE",
    "SIDECAR_DTYPE",
    "SURVIVAL_OUTPUT",
    "CopyProposal",
    "PackedLayout",
    "Verification",
    "acceptance_probability",
    "acceptance_uniforms",
    "allocate_target_rows",
    "append_context",
    "confidence_sidecar",
    "copy_confidence",
    "draft_confidence",
    "emitted_logprobs",
    "filtered_probs",
    "filtered_probs_by_lane",
    "greedy_tokens",
    "packed_layout",
    "pick_logprobs",
    "processed_log_probs_by_lane",
    "propose_copy",
    "reference_allocation",
    "reference_copy_proposal",
    "sample_draft_tokens",
    "sample_from_probs",
    "sampled_token_probability",
    "sidecar_shape",
    "speculative_survival",
    "stream_seed",
    "target_log_probs",
    "unpack_lane_rows",
    "verify_drafts",
    "verify_greedy",
    "write_confidence_sidecar",
]
