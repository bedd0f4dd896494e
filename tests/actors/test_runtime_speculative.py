"""Speculative decoding through the whole runtime on the real CPU backend with a tiny
random Llama pair: greedy output with speculation (fixed and adaptive modes, learned
draft and copy proposals) equals greedy output without it, token for token; multi-token
bursts are delivered; random cancellations return every page and state row.
Covers SPEC-5, SPEC-19, VER-28, ACC-28, QUEUE-3, QUEUE-4, LRN-10, MIX-7, PRE-53."""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest
import trio

from actors.config import RuntimeConfig
from actors.public import (
    Finished,
    GenerationRequest,
    RuntimeStatistics,
    SamplingParams,
    TokenDelta,
)
from actors.resource_book import ResourceStatistics
from actors.system import Runtime, open_runtime
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.learning import round_observations
from policy.scheduler import Scheduler
from tests.actors.test_runtime_cpu import config_for, prompt_of
from tests.actors.toy import wait_until_idle

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    repetitive = [5, 6, 7, 8, 9] * 6  # copy proposals find n-gram continuations here
    return [prompt_of(7, 1), prompt_of(30, 2), repetitive, prompt_of(50, 3)]


async def _greedy(rt: Runtime, prompt: list[int]) -> tuple[list[int], int]:
    tokens: list[int] = []
    deltas = 0
    request = GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=MAX_TOKENS,
                                sampling=GREEDY, ignore_eos=True)
    async with rt.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
                deltas += 1
            elif isinstance(event, Finished):
                assert event.reason == "length"
    return tokens, deltas


async def _serve_all(rt: Runtime) -> list[tuple[list[int], int]]:
    results: list[tuple[list[int], int]] = [([], 0)] * len(_prompts())

    async def one(i: int, prompt: list[int]) -> None:
        results[i] = await _greedy(rt, prompt)

    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(_prompts()):
            nursery.start_soon(one, i, prompt)
    return results


class Served(NamedTuple):
    """One ``_serve`` run: each prompt's (tokens, deltas), the runtime statistics and
    resource book once idle, and the scheduler it ran."""

    results: list[tuple[list[int], int]]
    stats: RuntimeStatistics
    resources: ResourceStatistics
    scheduler: object

    @property
    def graphs(self) -> dict[str, int]:
        return dict(self.stats.executions_by_graph)


async def _serve(config: RuntimeConfig) -> Served:
    """Serve the module's prompts on ``config`` and wait until the runtime is idle."""
    with trio.fail_after(240):
        async with open_runtime(config) as rt:
            results = await _serve_all(rt)
            await wait_until_idle(rt)
            return Served(results, rt.statistics(), rt.resources.statistics(), rt.scheduler)


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama: Path) -> list[list[int]]:
    """Greedy outputs of the same runtime without speculation (run once per module)."""

    async def serve() -> list[list[int]]:
        with trio.fail_after(120):
            async with open_runtime(config_for(tiny_llama)) as rt:
                return [tokens for tokens, _ in await _serve_all(rt)]

    return trio.run(serve)


@pytest.mark.parametrize(("mode", "source", "draft", "catch_up"), [
    ("fixed", "draft", "small", 0), ("adaptive", "draft", "small", 0),
    ("adaptive", "draft", "perfect", 0), ("fixed", "copy", None, 0),
    ("adaptive", "copy", None, 0), ("adaptive", "draft", "small", 8),
    ("adaptive", "draft", "perfect", 8)])
async def test_spec_5_greedy_speculation_equals_greedy_without_it(
        tiny_llama: Path, tiny_draft: Path, plain_outputs: list[list[int]], mode: str,
        source: str, draft: str | None, catch_up: int) -> None:
    """The target's own weights as the draft ("perfect") are always accepted, so the
    runtime must deliver multi-token bursts, each as one event. ``catch_up = 8``: a
    lagging draft context (decodes skip the draft, rounds catch up) keeps output too.
    ACC-33: the program counter equals the speculative launches, one per round."""
    draft_dir = {"small": tiny_draft, "perfect": tiny_llama, None: None}[draft]
    config = config_for(tiny_llama, speculation=mode, draft_source=source,
                        draft_model_dir=draft_dir, draft_depth=3, draft_catch_up=catch_up)
    served = await _serve(config)
    results, stats, resources, graphs = (served.results, served.stats, served.resources,
                                         served.graphs)
    assert isinstance(served.scheduler, Scheduler) and served.scheduler.speculation is not None
    assert [tokens for tokens, _ in results] == plain_outputs
    assert resources.rows_free == resources.rows_total
    speculative = sum(n for label, n in graphs.items() if label.startswith("spec"))
    assert speculative == stats.speculative_frames > 0, graphs
    assert stats.speculative_accepted_tokens <= stats.speculative_drafted_tokens
    assert sum(stats.speculative_accepted_by_position[:1]) <= stats.speculative_accepted_tokens
    if mode == "fixed":
        # MIX-7, LRN-10: fixed-width execution runs every decode step at W = D + 1.
        decoding = [label for label in graphs if not label.startswith("prefill")]
        assert decoding and all(",W=4," in label for label in decoding), graphs
    if draft == "perfect":
        assert stats.speculative_accepted_tokens > 0
        # bursts: fewer events than tokens for some stream
        assert any(deltas < len(tokens) for tokens, deltas in results)


@pytest.mark.parametrize(("mode", "source", "draft"), [
    ("adaptive", "draft", "perfect"), ("fixed", "draft", "small"), ("adaptive", "copy", None)])
async def test_mix_43_speculative_mixed_rows_keep_greedy_output(
        tiny_llama: Path, tiny_draft: Path, plain_outputs: list[list[int]], mode: str,
        source: str, draft: str | None) -> None:
    """Covers MIX-6, MIX-7, MIX-28..31, MIX-43, VER-13 end to end: with mixed prefill
    on, a speculative load serves wider mixed programs (a prompt chunk beside
    speculative decode rows, planned by the speculating Scheduler) and greedy output
    equals plain greedy output; every state row returns. Four prompts arriving at once
    leave prompts waiting while earlier requests decode, so an unmeasured wider mixed
    program is discovered (DUR-22). Fixed mode serves only width ``D + 1`` (MIX-7)."""
    draft_dir = {"small": tiny_draft, "perfect": tiny_llama, None: None}[draft]
    config = config_for(tiny_llama, speculation=mode, draft_source=source,
                        draft_model_dir=draft_dir, draft_depth=3, mixed_prefill=True)
    served = await _serve(config)
    graphs = served.graphs
    assert [tokens for tokens, _ in served.results] == plain_outputs
    assert served.resources.rows_free == served.resources.rows_total
    wider = {label: n for label, n in graphs.items()
             if label.startswith("mixed[") and ",spec" in label and ",W=1," not in label}
    assert wider, graphs
    if mode == "fixed":
        assert all(",W=4," in label for label in graphs
                   if not label.startswith("prefill")), graphs


@pytest.mark.parametrize("source", ["draft", "copy"])
async def test_queue_3_device_allocated_rounds_keep_greedy_output(
        tiny_llama: Path, tiny_draft: Path, plain_outputs: list[list[int]], source: str) -> None:
    """Ragged ``SpeculativePrefixLimit`` programs (ceilings, the device allocates P rows
    by joint prefix probability) complete with their confidence sidecar
    (``RoundCompletion``); greedy output is unchanged (SPEC-22, QUEUE-3)."""
    limit = TargetBinding.SPECULATIVE_PREFIX_LIMIT
    extra = (GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=4,
                        proposal_depth=3, packed_capacity=7, binding=limit),
             GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=3,
                        proposal_depth=2, packed_capacity=4, binding=limit))
    config = config_for(tiny_llama, speculation="adaptive", draft_source=source,
                        draft_model_dir=tiny_draft if source == "draft" else None,
                        draft_depth=3, extra_speculative_shapes=extra)
    served = await _serve(config)
    assert [tokens for tokens, _ in served.results] == plain_outputs
    assert any("SpeculativePrefixLimit" in label for label in served.graphs), served.graphs


async def test_random_cancellations_with_speculation_return_every_page_and_row(
        tiny_llama: Path) -> None:
    """PRE-53: resources return after random cancellations of speculative streams."""
    rng = random.Random(9)
    config = config_for(tiny_llama, max_queue=32, speculation="adaptive",
                        draft_source="draft", draft_model_dir=tiny_llama, draft_depth=3)
    with trio.fail_after(180):
        async with open_runtime(config) as rt:

            async def client(i: int) -> None:
                request = GenerationRequest(
                    prompt_token_ids=tuple(prompt_of(rng.randrange(3, 90), 300 + i)),
                    max_tokens=rng.randrange(1, 24),
                    sampling=SamplingParams(temperature=0.8, seed=i))
                cancel_after = rng.randrange(0, 6)
                with trio.move_on_after(rng.random() * 0.05):
                    async with rt.generate(request) as events:
                        seen = 0
                        async for _ in events:
                            seen += 1
                            if seen > cancel_after:
                                break

            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(client, i)
                    await trio.sleep(rng.random() * 0.01)
            await wait_until_idle(rt)
            stats = rt.resources.statistics()
            assert stats.rows_free == stats.rows_total
            assert stats.pages_total - stats.pages_free == stats.pages_cached
            assert rt.scheduler.statistics().resident == 0
            assert any(s.kind is GraphKind.SPECULATIVE for s in rt._parts.programs)


async def test_a_cache_hit_shares_the_draft_context(tiny_llama: Path) -> None:
    """A second turn that hits the prefix cache resumes speculation on the shared pages'
    draft KV: with the target's own weights as the draft every greedy draft is accepted,
    which fails if the cached pages lacked the draft's KV (SPEC-5, OPEN-35). Fixed
    mode, so that every decode step is a speculative round."""
    config = config_for(tiny_llama, speculation="fixed", draft_source="draft",
                        draft_model_dir=tiny_llama, draft_depth=3)
    first_prompt = prompt_of(40, 21)
    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            first, _ = await _greedy(rt, first_prompt)
            await wait_until_idle(rt)
            before = rt.statistics()
            second, _ = await _greedy(rt, [*first_prompt, *first, *prompt_of(5, 22)])
            after = rt.statistics()
        async with open_runtime(config_for(tiny_llama)) as plain:
            expected, _ = await _greedy(plain, [*first_prompt, *first, *prompt_of(5, 22)])
    assert after.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens
    assert second == expected
    drafted = after.speculative_drafted_tokens - before.speculative_drafted_tokens
    accepted = after.speculative_accepted_tokens - before.speculative_accepted_tokens
    assert drafted > 0 and accepted == drafted


async def _serve_recording_counterfactuals(
        config: RuntimeConfig) -> tuple[list[tuple[list[int], int]], RuntimeStatistics,
                                        list[tuple[int, int, bool]]]:
    """Serve the module's prompts on ``config`` recording every counterfactual the
    scheduler observes: (results, statistics once idle, observations)."""
    with trio.fail_after(240):
        async with open_runtime(config) as rt:
            observed = _record_counterfactuals(rt.scheduler)
            results = await _serve_all(rt)
            await wait_until_idle(rt)
            return results, rt.statistics(), observed


def _record_counterfactuals(scheduler: object, survivals: list[tuple[float, ...]] | None = None
                            ) -> list[tuple[int, int, bool]]:
    """Wrap ``scheduler.observe_counterfactual`` so each call is also recorded as
    ``(offered, accepted, terminated)`` in the returned list (and its survival values,
    when given, in ``survivals``)."""
    assert isinstance(scheduler, Scheduler) and scheduler.speculation is not None
    observed: list[tuple[int, int, bool]] = []
    original = scheduler.observe_counterfactual

    def record(handle: int, *, offered: int, accepted: int, terminated: bool,
               survival: tuple[float, ...] | None = None) -> None:
        observed.append((offered, accepted, terminated))
        if survivals is not None and survival is not None:
            survivals.append(tuple(survival))
        original(handle, offered=offered, accepted=accepted, terminated=terminated,
                 survival=survival)

    scheduler.observe_counterfactual = record  # type: ignore[method-assign]
    return observed


@pytest.mark.parametrize("enabled", [True, False])
async def test_copy_counterfactuals_reach_the_scheduler_and_keep_greedy_output(
        tiny_llama: Path, plain_outputs: list[list[int]], enabled: bool) -> None:
    """Adaptive copy speculation: frames that verified no copy drafts open counterfactual
    copy rounds (``actors.copy_counterfactuals``), decided ones reach
    ``observe_counterfactual`` with ``0 <= accepted <= offered <= D``; switched off
    (``copy_counterfactuals=False``, the seed's ACC-9) none do. Output is unchanged."""
    config = config_for(tiny_llama, speculation="adaptive", draft_source="copy",
                        draft_depth=3, copy_counterfactuals=enabled)
    results, stats, observed = await _serve_recording_counterfactuals(config)
    assert [tokens for tokens, _ in results] == plain_outputs
    assert stats.counterfactual_rounds == len(observed)
    assert stats.counterfactual_drafted_tokens == sum(o for o, _, _ in observed)
    assert stats.counterfactual_accepted_tokens == sum(a for _, a, _ in observed)
    if not enabled:
        assert observed == []
        return
    assert observed
    assert all(0 <= accepted <= offered <= 3 for offered, accepted, _ in observed)
    # the repetitive prompt's greedy continuation repeats: some drafts would have held
    assert any(accepted > 0 for _, accepted, _ in observed)


@pytest.mark.parametrize(("enabled", "catch_up"), [(True, 0), (False, 0), (True, 8)])
async def test_learned_depth_one_counterfactuals_reach_the_scheduler(
        tiny_llama: Path, plain_outputs: list[list[int]], enabled: bool,
        catch_up: int) -> None:
    """Adaptive learned speculation with the target as its own draft: every width-one
    step that keeps the draft context (decode or ``W = 1`` round) reports the draft's
    greedy proposal, which always equals the emitted token, so each reaches
    ``observe_counterfactual`` as one accepted draft of one offered. Switched off
    (``draft_counterfactuals=False``, the seed's ACC-9), or with a lagging draft context
    (no draft runs on those steps), none do. Output is unchanged."""
    config = config_for(tiny_llama, speculation="adaptive", draft_source="draft",
                        draft_model_dir=tiny_llama, draft_depth=3,
                        draft_counterfactuals=enabled, draft_catch_up=catch_up)
    results, stats, observed = await _serve_recording_counterfactuals(config)
    width_one = sum(n for label, n in stats.executions_by_graph
                    if label.startswith("decode") or ",W=1," in label)
    assert [tokens for tokens, _ in results] == plain_outputs
    assert stats.counterfactual_rounds == len(observed)
    assert stats.counterfactual_accepted_tokens == sum(a for _, a, _ in observed)
    if not enabled or catch_up:
        assert observed == []
        return
    assert width_one > 0 and observed
    assert set(observed) == {(1, 1, False)}


@pytest.mark.parametrize("draft", ["perfect", "small"])
async def test_sampled_requests_learn_from_depth_one_acceptance_probabilities(
        tiny_llama: Path, tiny_draft: Path, draft: str) -> None:
    """Sampled requests (temperature 0.8) in adaptive learned mode: each decode that
    keeps the draft context reports ``sum min(p, q)`` for the lane's token, which
    reaches ``observe_counterfactual`` as the depth-one survival value (ACC-28). With
    the target as its own draft the two distributions are equal, so every value is 1;
    the small random draft disagrees, so values lie in [0, 1] and some below 1."""
    config = config_for(tiny_llama, speculation="adaptive", draft_source="draft",
                        draft_model_dir=tiny_llama if draft == "perfect" else tiny_draft,
                        draft_depth=3)
    survivals: list[tuple[float, ...]] = []
    with trio.fail_after(240):
        async with open_runtime(config) as rt:
            _record_counterfactuals(rt.scheduler, survivals)

            async def one(i: int, prompt: list[int]) -> None:
                request = GenerationRequest(
                    prompt_token_ids=tuple(prompt), max_tokens=MAX_TOKENS, ignore_eos=True,
                    sampling=SamplingParams(temperature=0.8, seed=40 + i))
                async with rt.generate(request) as events:
                    async for _ in events:
                        pass

            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(_prompts()):
                    nursery.start_soon(one, i, prompt)
            await wait_until_idle(rt)
            stats = rt.statistics()
    decodes = sum(n for label, n in stats.executions_by_graph if label.startswith("decode"))
    assert survivals, (decodes, stats.executions_by_graph)
    assert all(len(v) == 1 and 0.0 <= v[0] <= 1.0 for v in survivals)
    if draft == "perfect":
        assert min(v[0] for v in survivals) > 0.999
    else:
        assert min(v[0] for v in survivals) < 0.999


@pytest.mark.parametrize("enabled", [True, False])
async def test_fully_accepted_learned_rounds_observe_one_depth_more(
        tiny_llama: Path, plain_outputs: list[list[int]], enabled: bool) -> None:
    """Adaptive learned speculation with the target as its own draft: every round
    accepts its drafts and reports that one more would have held (``RoundLane.beyond``),
    so the planner completes a ``D = 3`` round as four offered depths with survival
    values (1, 1, 1, 1): the depth-``(D + 1)`` counterfactual. With
    ``draft_counterfactuals=False`` (the seed's ACC-9) no lane is offered more than the
    deepest program's three drafts. Output is unchanged."""
    config = config_for(tiny_llama, speculation="adaptive", draft_source="draft",
                        draft_model_dir=tiny_llama, draft_depth=3,
                        draft_counterfactuals=enabled)
    offered_seen: list[int] = []
    survival_seen: list[tuple[float, ...]] = []
    with trio.fail_after(240):
        async with open_runtime(config) as rt:
            scheduler = rt.scheduler
            assert isinstance(scheduler, Scheduler) and scheduler.speculation is not None
            original = scheduler.complete
            depth_beyond = scheduler.speculation.settings.depth_beyond

            def record(fence, records, timing, *, round=None):  # type: ignore[no-untyped-def]
                if round is not None:  # what the scheduler learns from the round
                    survival, offered = round_observations(round.lanes,
                                                           depth_beyond=depth_beyond)
                    offered_seen.extend(offered.values())
                    survival_seen.extend(tuple(v) for v in survival.values())
                return original(fence, records, timing, round=round)

            scheduler.complete = record  # type: ignore[method-assign]
            results = await _serve_all(rt)
            await wait_until_idle(rt)
    assert [tokens for tokens, _ in results] == plain_outputs
    assert offered_seen
    if enabled:
        assert 4 in offered_seen and (1.0, 1.0, 1.0, 1.0) in survival_seen
    else:
        assert max(offered_seen) <= 3
