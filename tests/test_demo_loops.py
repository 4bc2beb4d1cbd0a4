"""The demo model's loss against greedy loops (scripts/demo_loops.py): what it marks as a loop,
what it penalises, and which prefixes it continues."""

from __future__ import annotations

import pytest
import torch
from scripts_loader import load_script


@pytest.fixture(scope="module")
def loops():
    return load_script("demo_loops")


def marked(loops, ids: list[int], start: int = 0) -> list[int]:
    mask = loops.loop_mask(torch.tensor([ids]), start=start)
    return [i for i, m in enumerate(mask[0].tolist()) if m]


def test_a_span_said_a_third_time_is_marked_from_its_first_token(loops):
    assert marked(loops, [9, 7, 7, 7, 7]) == [3, 4]  # period 1: the third 7 on
    assert marked(loops, [9, 1, 2, 1, 2, 1, 2, 8]) == [5, 6]  # period 2
    line = [10, 11, 12, 13, 14, 15]  # a "line" of six tokens, said three times
    assert marked(loops, [5] + line * 3) == list(range(13, 19))


def test_two_copies_and_repeats_far_apart_are_not_loops(loops):
    assert marked(loops, [1, 2, 3, 1, 2, 3, 4]) == []
    assert marked(loops, [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]) == []  # not in a row
    assert marked(loops, [4, 5, 6, 7, 8]) == []


def test_only_tokens_at_or_after_start_are_marked(loops):
    ids = [7, 7, 7, 7, 7, 7]
    assert marked(loops, ids, start=4) == [4, 5]
    assert marked(loops, ids) == [2, 3, 4, 5]


def test_periods_longer_than_the_limit_are_not_marked(loops):
    span = list(range(100, 140))  # 40 tokens
    mask = loops.loop_mask(torch.tensor([span * 3]), start=0, max_period=32)
    assert not mask.any()
    mask = loops.loop_mask(torch.tensor([span * 3]), start=0, max_period=40)
    assert mask[0, 80:].all() and not mask[0, :80].any()


def test_unlikelihood_is_minus_log_one_minus_p_of_the_marked_tokens(loops):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6)
    tokens = torch.tensor([[0, 3, 5, 3]])
    mark = torch.tensor([[False, False, True, True]])
    loss, hits = loops.unlikelihood_loss(logits, tokens, mark, generated=2)
    p = torch.softmax(logits[0], dim=-1)
    expected = -(torch.log(1 - p[1, 5]) + torch.log(1 - p[2, 3])) / 2
    assert hits == 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_step_against_the_loss_makes_the_looping_token_less_likely(loops):
    torch.manual_seed(1)
    logits = torch.randn(1, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 2]])
    mark = torch.tensor([[False, False, True]])
    before = torch.softmax(logits[0, 1], dim=-1)[2].item()
    loss, _ = loops.unlikelihood_loss(logits, tokens, mark, generated=1)
    loss.backward()
    with torch.no_grad():
        after = torch.softmax(logits[0, 1] - 0.5 * logits.grad[0, 1], dim=-1)[2].item()
    assert after < before
    assert logits.grad[0, 0].abs().sum() == 0  # unmarked positions get no gradient


def test_opening_lines_leave_out_the_judged_openings_and_indentation(loops):
    text = "import os\n    def helper(self, x):\n  # c\nimport collections\nx\n"
    lines = loops.opening_lines([text])
    assert "import os" not in lines  # one of the judged openings
    assert "def helper(self, x):" in lines and "import collections" in lines
    assert "# c" not in lines and "x" not in lines


def test_rollout_prefixes_are_pieces_of_the_training_data(loops):
    docs = [list(range(d * 1000, d * 1000 + 300)) for d in range(1, 4)]
    lines = [[7, 8, 9]] * 64 + [[1, 2]] * 10  # lengths with fewer than 64 lines are skipped
    prefixes = loops.RolloutPrefixes(docs, lines, seed=0)
    kinds = set()
    for _ in range(30):
        batch = prefixes.batch(4)
        assert batch.dim() == 2 and batch.shape[0] == 4
        for row in batch.tolist():
            if row == [7, 8, 9]:
                kinds.add("line")
                continue
            doc = docs[row[0] // 1000 - 1]
            start = doc.index(row[0])
            assert doc[start : start + len(row)] == row
            kinds.add("start" if start == 0 else "middle")
    assert kinds == {"line", "start", "middle"}


def test_file_starts_equal_to_a_judged_opening_are_never_prefixes(loops):
    docs = [[5, 6] + list(range(1000, 1300)), [7, 8] + list(range(2000, 2300))]
    prefixes = loops.RolloutPrefixes(docs, [], seed=0, avoid=frozenset({(5, 6)}))
    starts = [row for _ in range(200) for row in prefixes.batch(2).tolist() if row[0] in (5, 7)]
    assert [7, 8] in starts and [5, 6] not in starts
    assert any(row[:2] == [5, 6] and len(row) > 2 for row in starts)  # longer ones still come
