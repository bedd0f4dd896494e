"""What each request is told of its logprobs, decided from a validated frame.

Every program reports, per emitted token, its logprob and the ``TOP_LOGPROBS`` most
likely alternatives, and a scored prefill the same per prompt token
(``gpu.sampling.reported_log_probs``: the model's raw distribution; under
``RuntimeConfig.logprobs_mode`` ``processed_logprobs`` the sampler's own, with ``-inf``
for tokens it could not draw, scored prompts excepted). The host keeps
the first k alternatives a request asked for (``GenerationRequest.top_logprobs``) and
nothing for a request that asked for none, so the cost of a wider request is paid only
in the device's fixed-shape outputs, never in messages to the publisher.

A scoring request (``prompt_logprobs`` with ``max_tokens`` 0) is scheduled for one
output token, the one a prompt's last chunk samples anyway; the publisher discards it
(``OutputStream``). Pure functions: no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actors.messages import ValidatedFrame
from actors.public import Alternatives, GenerationRequest
from policy import GeneratedToken, RequestHandle


def scheduled_output_tokens(request: GenerationRequest) -> int:
    """The output tokens the scheduler plans for ``request``: its ``max_tokens``, and
    one for a scored prompt with ``max_tokens`` 0 (the sample a prompt ends with)."""
    return max(request.max_tokens, 1) if request.prompt_logprobs else request.max_tokens


def kept_alternatives(alternatives: Sequence[Alternatives], k: int) -> tuple[Alternatives, ...]:
    """The first ``k`` alternatives of each place; nothing at all when ``k`` is 0."""
    return tuple(a[:k] for a in alternatives) if k > 0 else ()


def token_logprobs(
    frame: ValidatedFrame, tokens: Sequence[GeneratedToken],
    top_logprobs_of: Callable[[RequestHandle], int],
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[Alternatives, ...], ...]]:
    """Per entry of ``tokens`` (``Scheduler.complete``'s committed tokens), the logprobs
    of its lane and the alternatives its request keeps (``top_logprobs_of(handle)``)."""
    tops = frame.top_logprobs or tuple(() for _ in frame.plan.lanes)
    by_handle = {lane.handle: (lp, top) for lane, lp, top in
                 zip(frame.plan.lanes, frame.logprobs, tops, strict=True)}
    logprobs: list[tuple[float, ...]] = []
    kept: list[tuple[Alternatives, ...]] = []
    for token in tokens:
        lp, top = by_handle.get(token.handle, ((), ()))
        logprobs.append(lp)
        kept.append(kept_alternatives(top[:len(lp)], top_logprobs_of(token.handle)))
    return tuple(logprobs), tuple(kept)
