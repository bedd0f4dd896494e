"""The scheduler's grammar rules (QUEUE-13, QUEUE-14, SEL-13; OPEN-22 as decided in
docs/design/requirements.md).

A grammar-constrained request's next allowed tokens depend on the token it sampled
last. Where only the host's matcher can turn that token into a mask (a host grammar,
the seed's case), the mask is a host-fed input; so:

- a plan whose lanes include a request with a host grammar requires completion
  feedback: it is committed only into an empty window and nothing queues behind it
  (QUEUE-13). The flag comes from the chosen plan's own lanes (QUEUE-14), so a plan
  without such lanes keeps both frame slots;
- a request whose grammar is resident where the frames run (``grammar_resident``:
  the executing process holds its matcher, advances it with each sampled token and
  computes the next mask itself, like the pending token and the penalty state) feeds
  the device nothing from the host, so its plans keep both frame slots. This is
  flare's extension of QUEUE-13 (docs/runtime.md, *Structured output*): the seed's
  rule stays for host grammars;
- constrained requests do not speculate (SEL-13: conditional acceptance respects the
  grammar; the complete speculative programs carry no mask). A speculative winner
  with a constrained lane gives way to the ordinary plan of the same decision;
- under fixed-width speculation (MIX-7, LRN-10: every decode row is verified at the
  fixed width), the ordinary programs decode only the requests that cannot speculate
  (``fixed_width_contexts``): the ordinary candidates see the constrained decoders
  (beside prompts, terminals and prerequisites), the speculative rounds see the
  others. So constrained requests decode on plain decode programs and every other
  request keeps decoding in rounds, never on a plain decode that could outrank a
  waiting prompt. This is flare's reading where the seed is silent (it fixes the width
  but not what a request that may not speculate runs on).

Pure: values in, decisions out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from policy.decision_context import DecisionContext
from policy.descriptors import GraphKind
from policy.requests import RequestRecord
from policy.types import DecodeMode, RequestHandle, ScheduledPlan


def cannot_speculate(record: RequestRecord) -> bool:
    """Whether ``record`` may never run on speculative rows (SEL-13: it is
    grammar-constrained, resident grammar or not)."""
    return record.grammar_constrained


def fixed_width_contexts(ctx: DecisionContext) -> tuple[DecisionContext, DecisionContext]:
    """Fixed-width mode's split of one decision (MIX-7, SEL-13): the context of the
    ordinary candidates, whose decoders are only those that cannot speculate, and the
    context of the speculative rounds, whose decoders are all the others. Everything
    else (prompts, terminals, prerequisites, ``waiting``) is shared. A catalog with no
    speculative program runs no rounds, so there the ordinary candidates keep every
    decoder."""
    if not any(s.kind is GraphKind.SPECULATIVE for s in ctx.catalog.shapes):
        return ctx, ctx
    decoders = ctx.decoders
    plain = decoders.subset(cannot_speculate)
    if not len(plain):
        return replace(ctx, decoders=plain), ctx
    return (replace(ctx, decoders=plain),
            replace(ctx, decoders=decoders.subset(lambda r: not cannot_speculate(r))))


def _constrained(plan: ScheduledPlan, records: Mapping[RequestHandle, RequestRecord], *,
                 host_only: bool = False) -> bool:
    """Whether a lane of ``plan`` is grammar-constrained (``host_only``: by a grammar
    the host feeds, not one resident where the frames run)."""
    for lane in plan.lanes:
        record = records.get(lane.handle)
        if (record is not None and record.grammar_constrained
                and not (host_only and record.grammar_resident)):
            return True
    return False


def with_grammar_feedback(plan: ScheduledPlan | None,
                          records: Mapping[RequestHandle, RequestRecord]
                          ) -> ScheduledPlan | None:
    """``plan``, marked as requiring completion feedback when a lane is constrained by
    a host grammar."""
    if (plan is None or plan.requires_empty_window
            or not _constrained(plan, records, host_only=True)):
        return plan
    return replace(plan, requires_empty_window=True)


def speculates(plan: ScheduledPlan) -> bool:
    """Whether ``plan`` runs speculative decode rows (a complete speculative round, or
    a mixed step in speculative decode mode)."""
    if plan.shape.kind is GraphKind.SPECULATIVE:
        return True
    mixed = plan.step.mixed
    return mixed is not None and mixed.decode_mode is DecodeMode.SPECULATIVE


def speculates_constrained(plan: ScheduledPlan | None,
                           records: Mapping[RequestHandle, RequestRecord]) -> bool:
    """Whether ``plan`` would put a constrained request on a speculative row."""
    return plan is not None and speculates(plan) and _constrained(plan, records)


def grammar_plan(ordinary: ScheduledPlan | None, chosen: ScheduledPlan | None,
                 records: Mapping[RequestHandle, RequestRecord]) -> ScheduledPlan | None:
    """The plan to return once speculation chose ``chosen`` over the decision's
    ``ordinary`` plan: the ordinary one when ``chosen`` would speculate a constrained
    request, either way marked for completion feedback where a lane has a host grammar."""
    if speculates_constrained(chosen, records):
        chosen = ordinary
    return with_grammar_feedback(chosen, records)
