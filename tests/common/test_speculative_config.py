"""--speculative-config: vLLM's JSON keys and defaults, and errors a user can act on."""

import pytest

from nanoserve.common.speculative_config import SpeculativeConfig


def test_vllm_shapes_parse_with_vllms_defaults():
    ngram = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}')
    suffix = SpeculativeConfig.from_json('{"method": "suffix"}')
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    draft = SpeculativeConfig.from_json('{"model": "some/dir", "num_speculative_tokens": 3}')
    assert draft.method == "draft_model" and draft.model == "some/dir"
    alias = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 1}
    )
    assert alias.method == "draft_model"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "one of ngram, suffix"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "in [1, 64]"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown"),
        ('{"num_speculative_tokens": 2}', "needs a method or a draft model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "draft model"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
        (  # Python's json reads Infinity; a draft as long as infinity times a match is none
            '{"method": "suffix", "suffix_decoding_max_spec_factor": Infinity}',
            "a finite max_spec_factor",
        ),
    ],
)
def test_bad_configs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_json(text)
