"""Acceptance estimates and confidence forecasts, per request and proposal source.

Seed section: *Completed confidence and acceptance* (ACC-1..9, ACC-17..28); seed module
``speculation.rs``. Which rounds to run is ``policy/rounds.py``'s and
``policy/learning.py``'s business; this module keeps the estimates they read.

Weight mechanics (decisions for OPEN-17):

- Every per-depth estimate starts at the population prior's mean with weight two: the
  prior counts as two pseudo-observations (ACC-21).
- Each observation at a depth is averaged in with weight one:
  ``mean <- (w*mean + v)/(w + 1)``, ``w <- min(w + 1, 128)`` (ACC-22). At the cap the
  estimate becomes an exponential average with step 1/129.
- Weights age with the request's own generated tokens: ``w <- w * 0.5**(n/128)`` after
  n generated tokens (ACC-23). Means never age; unobserved depths keep them (ACC-24).
- Population priors are kept per proposal source (learned draft, n-gram copy), one for
  forecasts and one for verified acceptance. Each starts at ``0.5**d`` for depth d
  (ACC-19) and moves toward each completed observation by 1/64 (ACC-20).
- Forecasts (completed joint-prefix probabilities) and verified acceptance are kept in
  separate estimates and never update each other (ACC-17).

Ordinary selection reads the means (ACC-25); funded acceptance learning reads
``min(1, mean + sqrt(ln 20 / (2 * aged_weight)))`` (ACC-26).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policy.descriptors import IdentityEnum

__all__ = [
    "AGEING_HALF_LIFE_TOKENS",
    "INITIAL_WEIGHT",
    "MAX_WEIGHT",
    "PRIOR_STEP",
    "AcceptanceState",
    "PopulationPrior",
    "PopulationPriors",
    "PrefixEstimate",
    "ProposalSource",
    "expected_output",
    "optimistic_bound",
]

INITIAL_WEIGHT = 2.0
"""The prior's pseudo-weight (ACC-21)."""
MAX_WEIGHT = 128.0
"""Cap on a per-depth weight (ACC-22)."""
AGEING_HALF_LIFE_TOKENS = 128
"""Weights halve every 128 tokens the request generates (ACC-23)."""
PRIOR_STEP = 1.0 / 64.0
"""How far a population prior moves toward each completed observation (ACC-20)."""
_LN_20 = math.log(20.0)


class ProposalSource(IdentityEnum):
    """Where a speculative round's proposals come from (ACC-5, OPEN-18)."""

    LEARNED = "draft"
    COPY = "copy"


def _default_prior(depth: int) -> float:
    return 0.5**depth


def _check_depth(depth: int) -> None:
    if depth < 1:
        raise ValueError(f"prefix depth starts at 1, got {depth}")


def _check_probabilities(values: Sequence[float], what: str) -> None:
    for v in values:
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"{what} must be probabilities in [0, 1], got {v!r}")


def optimistic_bound(mean: float, weight: float) -> float:
    """``min(1, mean + sqrt(ln(20) / (2 * weight)))``; 1 when the weight has aged to 0."""
    if weight <= 0.0:
        return 1.0
    return min(1.0, mean + math.sqrt(_LN_20 / (2.0 * weight)))


class PopulationPrior:
    """Per-depth population means: ``0.5**d`` at first, then 1/64 toward each observation."""

    def __init__(self) -> None:
        self._means: list[float] = []
        self.version = 0
        """Counts observations: equal versions mean equal means."""

    def mean(self, depth: int) -> float:
        """The prior mean at draft position ``depth`` (ACC-19)."""
        _check_depth(depth)
        return self._means[depth - 1] if depth <= len(self._means) else _default_prior(depth)

    def means(self, depth_limit: int) -> tuple[float, ...]:
        """Means for depths 1..depth_limit."""
        return tuple(self.mean(d) for d in range(1, depth_limit + 1))

    def observe(self, values: Sequence[float]) -> None:
        """Move depth d toward ``values[d-1]`` by 1/64 (ACC-20)."""
        _check_probabilities(values, "prior observations")
        self.version += 1
        while len(self._means) < len(values):
            self._means.append(_default_prior(len(self._means) + 1))
        for i, v in enumerate(values):
            self._means[i] += (v - self._means[i]) * PRIOR_STEP


class PopulationPriors:
    """The population priors of one scheduler: per source, forecast and acceptance."""

    def __init__(self) -> None:
        self._forecast = {s: PopulationPrior() for s in ProposalSource}
        self._acceptance = {s: PopulationPrior() for s in ProposalSource}
        self._fresh: tuple[tuple[int, ...], AcceptanceState] | None = None

    def forecast(self, source: ProposalSource) -> PopulationPrior:
        """The prior a new request's forecast starts from (ACC-18)."""
        return self._forecast[source]

    def acceptance(self, source: ProposalSource) -> PopulationPrior:
        """The prior a new request's acceptance estimate starts from."""
        return self._acceptance[source]

    def fresh_state(self) -> AcceptanceState:
        """A read-only view of what a request without history would start from: one
        ``AcceptanceState`` shared until any prior moves (selection reads it for every
        decoding request that has no state yet). Never observe into it."""
        version = tuple(p.version for table in (self._forecast, self._acceptance)
                        for p in table.values())
        if self._fresh is None or self._fresh[0] != version:
            self._fresh = (version, AcceptanceState(self))
        return self._fresh[1]


class PrefixEstimate:
    """Per-depth means with aged weights (ACC-21..26). Depth 1 is the first draft position.

    Depths never observed read the prior snapshot taken at creation (or ``0.5**d`` beyond
    it) with the initial weight, aged like every other depth.
    """

    def __init__(self, prior: Sequence[float] = ()) -> None:
        _check_probabilities(prior, "prior means")
        self._prior = tuple(prior)
        self._means: list[float] = []
        self._weights: list[float] = []
        self._unobserved_weight = INITIAL_WEIGHT
        self._rows: dict[tuple[str, int], tuple[float, ...]] = {}
        """Memo of ``means``/``weights``/``optimistic_bounds`` per depth limit; cleared by
        ``observe``, and of its weight rows by ``age``. Selection reads them on every
        decision."""

    @classmethod
    def preseeded(cls, means: Sequence[float], weight: float) -> PrefixEstimate:
        """An estimate that already holds ``means`` at ``weight`` each (OPEN-34).

        For tests, simulations and warm starts; deeper depths read ``0.5**d`` at the
        initial weight.
        """
        if not (math.isfinite(weight) and 0.0 < weight <= MAX_WEIGHT):
            raise ValueError(f"weight must lie in (0, {MAX_WEIGHT}], got {weight!r}")
        estimate = cls(means)
        estimate._means = list(estimate._prior)
        estimate._weights = [float(weight)] * len(estimate._prior)
        return estimate

    def _prior_mean(self, depth: int) -> float:
        return self._prior[depth - 1] if depth <= len(self._prior) else _default_prior(depth)

    def mean(self, depth: int) -> float:
        """The historical mean at ``depth`` (what ordinary selection uses, ACC-25)."""
        _check_depth(depth)
        return self._means[depth - 1] if depth <= len(self._means) else self._prior_mean(depth)

    def weight(self, depth: int) -> float:
        """The aged weight at ``depth`` (2 for a new estimate, ACC-21)."""
        _check_depth(depth)
        if depth <= len(self._weights):
            return self._weights[depth - 1]
        return self._unobserved_weight

    def optimistic(self, depth: int) -> float:
        """``min(1, mean + sqrt(ln 20 / (2 w)))`` (ACC-26)."""
        return optimistic_bound(self.mean(depth), self.weight(depth))

    def means(self, depth_limit: int) -> tuple[float, ...]:
        """Means for depths 1..depth_limit."""
        row = self._rows.get(("mean", depth_limit))
        if row is None:
            row = self._rows["mean", depth_limit] = tuple(
                self.mean(d) for d in range(1, depth_limit + 1))
        return row

    def weights(self, depth_limit: int) -> tuple[float, ...]:
        """Aged weights for depths 1..depth_limit (``weight`` per depth, built at once:
        selection rebuilds the row after every ageing)."""
        row = self._rows.get(("weight", depth_limit))
        if row is None:
            observed = self._weights[:depth_limit]
            row = self._rows["weight", depth_limit] = (
                *observed, *(self._unobserved_weight,) * (depth_limit - len(observed)))
        return row

    def optimistic_bounds(self, depth_limit: int) -> tuple[float, ...]:
        """The ACC-26 bound for depths 1..depth_limit."""
        row = self._rows.get(("optimistic", depth_limit))
        if row is None:
            row = self._rows["optimistic", depth_limit] = tuple(
                optimistic_bound(m, w) for m, w in zip(
                    self.means(depth_limit), self.weights(depth_limit), strict=True))
        return row

    def observe(self, values: Sequence[float]) -> None:
        """One observation per depth: ``values[d-1]`` for depths 1..len(values).

        Depths past ``len(values)`` are left alone (ACC-8, ACC-24).
        """
        _check_probabilities(values, "observations")
        self._rows.clear()
        while len(self._means) < len(values):
            depth = len(self._means) + 1
            self._means.append(self._prior_mean(depth))
            self._weights.append(self._unobserved_weight)
        for i, v in enumerate(values):
            w = self._weights[i]
            self._means[i] = (w * self._means[i] + v) / (w + 1.0)
            self._weights[i] = min(w + 1.0, MAX_WEIGHT)

    def age(self, generated_tokens: int) -> None:
        """Scale every weight by ``0.5 ** (generated_tokens / 128)`` (ACC-23)."""
        if generated_tokens < 0:
            raise ValueError(f"generated tokens must be non-negative, got {generated_tokens}")
        if generated_tokens == 0:
            return
        # ageing moves weights only: the memoised means stay valid
        self._rows = {key: row for key, row in self._rows.items() if key[0] == "mean"}
        factor = 0.5 ** (generated_tokens / AGEING_HALF_LIFE_TOKENS)
        self._weights = [w * factor for w in self._weights]
        self._unobserved_weight *= factor


class AcceptanceState:
    """One request's acceptance and forecast estimates, by proposal source (ACC-5, ACC-17).

    Observations also move the shared population priors, so later requests start from
    what the population has shown.
    """

    def __init__(self, priors: PopulationPriors | None = None) -> None:
        self._priors = priors if priors is not None else PopulationPriors()
        self._acceptance: dict[ProposalSource, PrefixEstimate] = {}
        self._forecast: dict[ProposalSource, PrefixEstimate] = {}

    @staticmethod
    def _get(
        table: dict[ProposalSource, PrefixEstimate],
        prior: PopulationPrior,
        source: ProposalSource,
    ) -> PrefixEstimate:
        estimate = table.get(source)
        if estimate is None:
            # Snapshot the population's current means at the request's first use.
            estimate = table[source] = PrefixEstimate(prior.means(_PRIOR_SNAPSHOT_DEPTH))
        return estimate

    def preseed(
        self, source: ProposalSource, means: Sequence[float], weight: float = MAX_WEIGHT
    ) -> None:
        """Replace the request's acceptance estimate for ``source`` (OPEN-34, VER-23).

        The population prior is not moved: a preseeded history is not an observation.
        """
        self._acceptance[source] = PrefixEstimate.preseeded(means, weight)

    def acceptance(self, source: ProposalSource) -> PrefixEstimate:
        """The verified-acceptance estimate for ``source``."""
        return self._get(self._acceptance, self._priors.acceptance(source), source)

    def forecast(self, source: ProposalSource) -> PrefixEstimate:
        """The confidence-forecast estimate for ``source`` (ACC-18)."""
        return self._get(self._forecast, self._priors.forecast(source), source)

    def survival(self, source: ProposalSource, depth_limit: int) -> tuple[float, ...]:
        """Estimated prefix survival s_1..s_n (n = ``depth_limit``) from the means.

        A longer prefix cannot survive more often than a shorter one, so the sequence is
        made non-increasing with a running minimum.
        """
        return _non_increasing(self.acceptance(source).means(depth_limit))

    def optimistic_survival(self, source: ProposalSource, depth_limit: int) -> tuple[float, ...]:
        """The ACC-26 optimistic bound per depth, for funded acceptance learning."""
        return self.acceptance(source).optimistic_bounds(depth_limit)

    def forecast_means(self, source: ProposalSource, depth_limit: int) -> tuple[float, ...]:
        """The request's averaged joint-prefix probabilities for depths 1..n."""
        return self.forecast(source).means(depth_limit)

    def observe_round(
        self,
        source: ProposalSource,
        *,
        offered: int,
        accepted: int,
        terminated: bool,
        survival: Sequence[float] | None = None,
    ) -> None:
        """Fold one verified round into the acceptance estimate (ACC-6..9, ACC-28).

        Depths 1..accepted observe 1, depths accepted+1..offered observe 0, unless the
        request terminated, which censors everything past the accepted prefix (ACC-8).
        ``survival`` values, when the program wrote them, replace the binary observation
        at their depths (ACC-28). A width-one round (``offered == 0``) observes nothing
        (ACC-9).
        """
        if offered < 0 or not 0 <= accepted <= offered:
            raise ValueError(f"need 0 <= accepted <= offered, got {accepted}/{offered}")
        values = [1.0] * accepted + [0.0] * (offered - accepted)
        if survival is not None:
            _check_probabilities(survival, "survival values")
            for i, s in enumerate(survival[:offered]):
                values[i] = float(s)
        if terminated:
            values = values[:accepted]
        if not values:
            return
        self.acceptance(source).observe(values)
        self._priors.acceptance(source).observe(values)

    def observe_forecast(
        self, source: ProposalSource, joint_prefix_probabilities: Sequence[float]
    ) -> None:
        """Fold a completed round's joint-prefix probabilities into the forecast (ACC-18, ACC-20).

        The caller passes only the completed round's values up to each lane's frozen
        ceiling (ACC-13, LRN-12).
        """
        if not joint_prefix_probabilities:
            return
        self.forecast(source).observe(joint_prefix_probabilities)
        self._priors.forecast(source).observe(joint_prefix_probabilities)

    def age(self, generated_tokens: int) -> None:
        """Age every estimate of this request by its own generated tokens (ACC-23)."""
        for table in (self._acceptance, self._forecast):
            for estimate in table.values():
                estimate.age(generated_tokens)


_PRIOR_SNAPSHOT_DEPTH = 32
"""Depths of the population prior copied into a new request's estimate; deeper positions
fall back to ``0.5**d`` (no program is near 32 draft positions)."""


def _non_increasing(values: Sequence[float]) -> tuple[float, ...]:
    out: list[float] = []
    low = 1.0
    for v in values:
        low = min(low, v)
        out.append(low)
    return tuple(out)


def expected_output(
    survival: Sequence[float], *, width: int, alpha: float, limit: int
) -> float:
    """``1 + sum(s_i**alpha for i < width)``, at most ``limit`` (ACC-1..3).

    ``width`` is the lane's verification width W (the pending token plus W-1 proposals),
    already reduced to the proposals available; ``limit`` bounds the result by output
    limits and context (ACC-2, SEL-13). Missing survival entries count as zero.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be finite and positive, got {alpha!r}")
    total = 1.0 + math.fsum(math.pow(s, alpha) for s in survival[: width - 1])
    return max(0.0, min(total, float(limit)))
