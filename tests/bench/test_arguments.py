"""`nanoserve bench` arguments: defaults that depend on no checkout, and checks with messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.bench.arguments import parse_args
from nanoserve.bench.workloads import WORKLOADS


def test_results_go_under_the_current_directory_by_default():
    args = parse_args([])
    assert args.output_root == Path("benchmarks") / "results"
    assert not args.output_root.is_absolute()


def test_all_workloads_and_concurrency_levels():
    args = parse_args(["--workload", "sweep", "all", "--concurrency", "1, 4,16"])
    assert args.workload == list(WORKLOADS)
    assert args.concurrency == [1, 4, 16]


def test_requests_are_greedy_unless_a_temperature_is_given():
    assert parse_args([]).temperature == 0.0
    assert parse_args(["--temperature", "0.7"]).temperature == 0.7


def test_workloads_add_up_across_repeated_flags():
    assert parse_args([]).workload == ["scoreboard"]
    args = parse_args(["--workload", "scoreboard", "--workload", "autocomplete", "scoreboard"])
    assert args.workload == ["scoreboard", "autocomplete"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "1,x"], "--concurrency must be comma-separated integers"),
        (["--concurrency", "0,2"], "--concurrency levels must be ≥ 1"),
        (["--rounds", "0"], "--rounds must be ≥ 1"),
        (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
        (["--temperature", "-0.5"], "--temperature must be in [0, 2]"),
        (["--temperature", "2.5"], "--temperature must be in [0, 2]"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
