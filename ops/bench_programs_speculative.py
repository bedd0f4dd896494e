"""``flare bench programs --speculation``: each speculative round against the plain
decode step of its request bucket (the comparison table below the timings)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ops.bench_programs import ShapeTiming


def speculative_comparison(catalog: Any, results: list[ShapeTiming],
                           plain: list[ShapeTiming]) -> list[dict[str, Any]]:
    """Per request bucket: the plain decode step, the draft-maintaining decode step and
    every separate speculative round (by width, host then device allocation), each
    with its ratio to the plain decode step. Times (``ms``) are the executing thread's
    CPU time where the backend gives it (cpu), else the device interval."""
    from policy.descriptors import GraphKind

    by_label = {r.label: r for r in results}
    plain_by_label = {r.label: r for r in plain}

    def ms(r: ShapeTiming) -> float:
        return r.cpu_ms if r.cpu_ms is not None else r.device_ms

    buckets = []
    for decode in catalog.of_kind(GraphKind.DECODE):
        b = decode.batch_capacity
        base = ms(plain_by_label.get(decode.label(), by_label[decode.label()]))
        rounds = [
            {"shape": s.label(), "width": s.token_capacity, "rows": s.max_packed_extent,
             "binding": s.binding.value if s.binding else "",
             "ms": round(ms(by_label[s.label()]), 4),
             "device_ms": round(by_label[s.label()].device_ms, 4),
             "ratio": round(ms(by_label[s.label()]) / base, 3)}
            for s in sorted(catalog.of_kind(GraphKind.SPECULATIVE),
                            key=lambda s: (s.binding.value if s.binding else "",
                                           s.token_capacity, s.max_packed_extent))
            if s.batch_capacity == b]
        if rounds:
            buckets.append({"batch": b, "decode_ms": round(base, 4),
                            "maintaining_decode_ms": round(ms(by_label[decode.label()]), 4),
                            "rounds": rounds})
    return buckets


def format_comparison(buckets: list[dict[str, Any]]) -> str:
    lines = []
    for bucket in buckets:
        head = (f"B={bucket['batch']}: decode {bucket['decode_ms']:.2f}  "
                f"(draft-maintaining {bucket['maintaining_decode_ms']:.2f})")
        cells = []
        for r in bucket["rounds"]:
            ragged = f",P={r['rows']}" if r["rows"] != bucket["batch"] * r["width"] else ""
            tag = " device" if r["binding"] == "SpeculativePrefixLimit" else ""
            cells.append(f"W={r['width']}{ragged}{tag} {r['ms']:.2f} ({r['ratio']:.2f}x)")
        lines.append(head)
        lines.append("    " + "  ".join(cells))
    return "\n".join(lines)
