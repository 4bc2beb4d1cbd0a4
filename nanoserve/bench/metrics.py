"""Summaries of a phase's request results: throughput and mean/p50/p90/p99 latencies."""

from __future__ import annotations

import numpy as np

from nanoserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (None when there is no sample)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    summary: dict[str, float | None] = {"mean": float(values_ms.mean())}
    for p in PERCENTILES:
        summary[f"p{p}"] = float(np.percentile(values_ms, p))
    return summary


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Everything the tables show for one phase, from its requests and its wall time."""
    ok = [r for r in results if r.is_ok]
    # Every request that got a first token, dropped after it or not: autocomplete drops most
    # requests before their last token, and the time to the first is what the editor shows.
    answered = [r.ttft_s for r in results if r.error is None and r.ttft_s is not None]
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    # What each user sees: their tokens over their request's whole time; and the decode speed
    # alone (tokens after the first over the time after the first).
    stream_tok_s = [r.output_tokens / r.e2e_s for r in ok if r.output_tokens and r.e2e_s]
    decode_tok_s = [1.0 / r.tpot_s for r in ok if r.tpot_s]
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": sum(r.error is not None for r in results),
        "num_dropped": sum(r.dropped for r in results),
        "num_answered": len(answered),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (
            (prompt_tokens + output_tokens) / duration_s if duration_s > 0 else None
        ),
        "per_stream_tok_s_mean": float(np.mean(stream_tok_s)) if stream_tok_s else None,
        "decode_tok_s_mean": float(np.mean(decode_tok_s)) if decode_tok_s else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_answered_ms": distribution_ms(answered),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
