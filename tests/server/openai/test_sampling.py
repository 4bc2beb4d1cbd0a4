"""An unset max_tokens (the rest of the context) is lowered so that the request's logprobs fit
their bound; one the request set is left for the check to refuse."""

from __future__ import annotations

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.openai.checks import MAX_LOGPROB_ENTRIES, num_logprob_entries
from nanoserve.server.openai.sampling import fit_logprobs_bound


def test_an_unset_max_tokens_is_lowered_to_fit_the_logprobs_bound() -> None:
    params = SamplingParams(n=2, max_tokens=131_000, logprobs=20, prompt_logprobs=1)
    fitted = fit_logprobs_bound(params, num_prompt=1001)
    # 2 x 1,000 x 2 prompt entries, then 2 x 21 per generated token
    assert fitted.max_tokens == (MAX_LOGPROB_ENTRIES - 4000) // 42 == 24_870
    assert num_logprob_entries(1001, fitted) <= MAX_LOGPROB_ENTRIES
    assert (fitted.n, fitted.logprobs, fitted.prompt_logprobs) == (2, 20, 1)


def test_what_fits_is_kept() -> None:
    for params in (
        SamplingParams(max_tokens=131_000),  # no logprobs
        SamplingParams(max_tokens=40_000, logprobs=20),  # 840,000 entries
    ):
        assert fit_logprobs_bound(params, num_prompt=10) is params
