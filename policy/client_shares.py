"""flare's per-client fairness extension: fairness prices weighted by the request's client.

Not the seed. The seed gives every request one log-utility term (``f log x_i + g log
z_i``, SEL-5..7), so a client with three times the resident requests holds three times
the fairness weight and receives three times the service. With ``client_fairness`` s > 0
(the ``client-fair`` preset) each request's fairness terms are weighted by its client's
share::

    w_c = (n / (k * n_c)) ** s

where n is the number of resident requests with work (prefill or decode), k the number
of clients among them and n_c the number that belong to client c. The weights sum to n,
the seed's total fairness weight, and with s = 1 every client's requests together hold
the same weight n/k, whatever their number: the proportional-fair optimum then gives
each backlogged client an equal share of the device, and a client asking for less than
that share is served as fast as it asks. The price gradients become ``1 + w_c f/x_i``,
``beta + w_c f/x_i`` and ``w_c g/z_i``; within a client, a request with less recent
service is still priced higher. A request without a client tag (an empty ``user``) is
its own client, so untagged traffic, one client, or one request per client is priced
exactly as the seed prices it. ``docs/scheduling-utility.md`` (U-11) has the rule.

Weighting a price ``f/x`` by ``w`` is pricing the rate ``x/w``: this module returns
*views* of the (projected) histories with both rates divided by the weight, so every
price function and the decision's scaling exponent apply unchanged. Views are copies
used for pricing only; stored rates never change (SEL-10, ACCT-21). Pure and cheap:
one pass over the resident records per decision, only when s > 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from policy.config import PolicyConfig
from policy.requests import RequestRecord
from policy.service import ServiceHistory
from policy.types import Phase, RequestHandle

__all__ = ["client_rate_views", "client_weights"]

_SHARING = (Phase.PREFILL, Phase.DECODE)


def client_weights(records: Mapping[RequestHandle, RequestRecord],
                   exponent: float) -> dict[RequestHandle, float]:
    """``w_c = (n / (k * n_c)) ** exponent`` for every resident request with work."""
    clients: dict[object, list[RequestHandle]] = {}
    for r in records.values():
        if r.cancelled or r.phase not in _SHARING:
            continue
        key: object = r.client if r.client else ("untagged", r.handle)
        clients.setdefault(key, []).append(r.handle)
    n = sum(len(members) for members in clients.values())
    k = len(clients)
    weights: dict[RequestHandle, float] = {}
    for members in clients.values():
        w = (n / (k * len(members))) ** exponent
        for handle in members:
            weights[handle] = w
    return weights


def client_rate_views(records: Mapping[RequestHandle, RequestRecord],
                      histories: Mapping[RequestHandle, ServiceHistory],
                      config: PolicyConfig) -> dict[RequestHandle, ServiceHistory]:
    """Histories to price from: ``histories`` (the projected copies) or the stored
    history, with x, z and the fair-share z divided by the request's client weight."""
    views = dict(histories)
    for handle, w in client_weights(records, config.client_fairness).items():
        base = histories.get(handle)
        if base is None:
            base = records[handle].history
        if w == 1.0:
            continue
        z = base.delivery_rate
        views[handle] = ServiceHistory(base.token_rate / w, None if z is None else z / w,
                                       base.fair_delivery_rate / w)
    return views
