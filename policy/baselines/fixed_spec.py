"""``fixed-spec-K``: every decode batch is a complete speculative round at depth K.

The classic speculative decoding configuration of conventional servers (vLLM's
``num_speculative_tokens=K``): whenever requests decode, each is given K drafted tokens
plus its pending token, i.e. ``K + 1`` target rows (fewer only when its output limit
leaves less room), verified by one complete speculative program, whatever its
acceptance: no estimates, no choice of width, never an ordinary decode. Prompts are
chunked under a token budget like ``sarathi`` and alternate with the rounds (flare
prepares no speculative mixed programs, so decodes do not ride in prompt chunks).

Programs: the host-allocated (``QueryLength``) speculative programs of the narrowest
width ``W >= K + 1`` whose proposal depth reaches K (``ShapeMenu.round_shapes``). A
round runs on the smallest batch bucket holding its lanes and rows, so it never exceeds
the program's B or P, nor the token budget. Running slots (``max_num_seqs``) are the
largest such bucket's rows. When more decoders wait than one round holds (a packed
capacity P below B * W), the least recently served go first, so every stream advances.

Rounds complete like any generation frame: each lane commits between 1 and its host
length of tokens (``BaselinePolicy.complete``), which is what the runtime's validator
and the simulator deliver for ``QueryLength`` programs (QUEUE-3: device-allocated
programs, which need their confidence sidecar, are never used here). A round may queue
behind a round (QUEUE-11); a prompt chunk drains the window.

A catalog without speculative programs makes the policy run exactly like ``sarathi``;
one whose speculative programs cannot verify K drafts is refused.

Seed comparison: the seed's speculating scheduler (``policy/round_speculation.py``)
prices every width against ordinary decode from each request's learned acceptance
(SPEC-6, SEL-24..34); this baseline is the fixed point it should beat when acceptance
varies across requests or is low.
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.baselines.base import BaselineRequest
from policy.baselines.menu import ShapeMenu, largest_at_most
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.config import PolicyConfig
from policy.descriptors import GraphShape
from policy.types import PolicyError, ScheduledStep

FIXED_SPEC_PREFIX = "fixed-spec-"
"""Policy names ``fixed-spec-1`` .. ``fixed-spec-7``: the prefix plus the depth K."""
MAX_FIXED_DEPTH = 7
"""The deepest proposal depth a flare speculative load prepares (``--draft-depth``)."""


class FixedSpecPolicy(SarathiPolicy):
    """Complete speculative rounds of ``depth + 1`` rows per lane; chunked prefill."""

    rounds_decode = True

    def __init__(self, config: PolicyConfig | None = None,
                 catalog: Iterable[GraphShape] = (), *, depth: int,
                 token_budget: int = DEFAULT_TOKEN_BUDGET) -> None:
        if not 1 <= depth <= MAX_FIXED_DEPTH:
            raise PolicyError(f"fixed speculative depth must be 1..{MAX_FIXED_DEPTH}, "
                              f"got {depth}")
        self.depth = depth
        self.name = f"{FIXED_SPEC_PREFIX}{depth}"
        self._round_shapes: tuple[GraphShape, ...] = ()
        super().__init__(config, catalog, token_budget=token_budget)

    @property
    def rows(self) -> int:
        """Target rows per lane of a full round: K drafts plus the pending token."""
        return self.depth + 1

    @property
    def round_shapes(self) -> tuple[GraphShape, ...]:
        """The speculative programs rounds run on (empty: the catalog has none)."""
        return self._round_shapes

    def _own_running_limit(self) -> int:
        if self._round_shapes:
            return max(s.batch_capacity for s in self._round_shapes)
        return super()._own_running_limit()

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None:
        super().set_catalog(shapes)
        self._round_shapes = self._menu.round_shapes(self.rows)

    def _check_catalog(self, menu: ShapeMenu) -> None:
        super()._check_catalog(menu)
        if not menu.speculative:
            return
        if not menu.round_shapes(self.rows):
            deepest = max(s.proposal_depth for s in menu.speculative)
            raise PolicyError(
                f"{self.name} needs QueryLength speculative programs of width >= "
                f"{self.rows} and proposal depth >= {self.depth}; the catalog's deepest "
                f"is {deepest} (load a deeper draft depth)")
        if self.token_budget < self.rows:
            raise PolicyError(f"token budget {self.token_budget} is below one lane's "
                              f"{self.rows} rows")

    def _choose(self) -> ScheduledStep | None:
        if not self._round_shapes:
            return super()._choose()
        menu = self._menu
        decoders = self._decoders()
        prompt = self._next_prompt()
        if prompt is not None and not (decoders and self._last_step_had_prompt):
            room = largest_at_most(menu.prefill_capacities(), self.token_budget)
            return menu.prefill_step(prompt.prompt_work(min(prompt.chunk_limit(), room)))
        if decoders:
            return self._round(decoders)
        return None

    def _round(self, decoders: list[BaselineRequest]) -> ScheduledStep | None:
        """The next round: least recently served decoders first, each with
        ``min(K + 1, output room)`` rows, first fit into the widest bucket's B, its P
        and the token budget; lanes in admission order."""
        widest = self._round_shapes[-1]
        room = min(widest.max_packed_extent, self.token_budget)
        chosen: list[BaselineRequest] = []
        used = 0
        for req in sorted(decoders, key=lambda r: (r.rounds, r.sequence)):
            if len(chosen) == widest.batch_capacity:
                break
            rows = min(self.rows, req.output_room)
            if used + rows <= room:
                chosen.append(req)
                used += rows
        if not chosen:
            return None
        chosen.sort(key=lambda r: r.sequence)
        return self._menu.round_step(self._round_shapes, [
            (r.handle, r.epoch, min(self.rows, r.output_room)) for r in chosen])


def fixed_spec_depth(name: str) -> int | None:
    """K for a ``fixed-spec-K`` policy name (None for any other name)."""
    if not name.startswith(FIXED_SPEC_PREFIX):
        return None
    digits = name[len(FIXED_SPEC_PREFIX):]
    return int(digits) if digits.isdigit() else None
