"""The kernels' suffix tries against spec_decode/suffix.py's: the same drafts through growth,
counting in and out, and every draft setting; and the CPU platform's suffix proposer uses them."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.engine_setup import build_engine
from nanoserve.spec_decode import suffix

# (max_tokens, max_spec_factor, min_prob); a factor past any int, as no config allows, too
SETTINGS = [(24, 1.0, 0.1), (4, 3.0, 0.0), (9, 0.5, 0.3), (8, 1.0, 0.5), (3, 0.0, 0.1)]
SETTINGS += [(5, 1e300, 0.0)]


@pytest.mark.parametrize("depth", [1, 2, 5, 24])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_the_same_drafts_as_the_python_tries(kernels, depth, vocab):
    rng = random.Random(depth * 100 + vocab)
    own_py, own_cc = suffix.GrowingSuffixTrie(depth), kernels.GrowingSuffixTrie(depth)
    shared_py, shared_cc = suffix.SuffixTrie(depth), kernels.SuffixTrie(depth)
    tokens: list[int] = []
    cached: list[list[int]] = []
    for step in range(50):
        new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]  # repeats: long matches
        own_py.extend(new)
        own_cc.extend(new)
        tokens += new
        assert own_cc.num_tokens == own_py.num_tokens == len(tokens)
        if step % 5 == 0:  # an output joins the shared trie; the oldest leaves, in two parts
            cached.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))])
            for trie in (shared_py, shared_cc):
                trie.add(cached[-1])
            if len(cached) > 3:
                old, middle = cached.pop(0), rng.randrange(0, 3)
                for trie in (shared_py, shared_cc):
                    trie.add(old, -1, 0, middle)
                    trie.add(old, -1, middle, None)
        for setting in SETTINGS:
            assert own_cc.draft_after_own(*setting) == own_py.draft_after_own(*setting)
            assert own_cc.draft(tokens, *setting) == own_py.draft(tokens, *setting)
            assert shared_cc.draft(tokens, *setting) == shared_py.draft(tokens, *setting)


def test_a_sequence_counted_out_leaves_nothing_to_draft_from(kernels):
    trie = kernels.SuffixTrie(4)
    trie.add([1, 2, 3, 1, 2, 3])
    assert trie.draft([1, 2], 4, 4.0, 0.0) == ([3, 1, 2], 2.0)  # after "2": 3, 1, 2
    nodes = trie.num_nodes
    trie.add([1, 2, 3, 1, 2, 3], -1)
    assert trie.draft([1, 2], 4, 4.0, 0.0) == ([], 0.0)
    trie.add([1, 2, 3, 1, 2, 3])
    assert trie.num_nodes == nodes  # the freed nodes were made again


def test_the_cpu_platform_drafts_suffixes_with_the_kernels_tries(kernels, tmp_path):
    speculative = SpeculativeConfig.from_dict({"method": "suffix"})
    config = EngineConfig(
        model=str(make_tiny_checkpoint(tmp_path)),
        device="cpu",
        max_model_len=64,
        speculative_config=speculative,
    )
    engine = build_engine(config)
    proposer = engine.speculator.proposer
    assert isinstance(proposer, suffix.SuffixProposer)
    assert isinstance(proposer.global_trie, kernels.SuffixTrie)
    assert proposer.kinds.own is kernels.GrowingSuffixTrie
    engine.shutdown()
