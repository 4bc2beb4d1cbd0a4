"""`nanoserve serve`'s flags for speed (compile, eager, quantization) and for parallelism
(tensor-parallel ranks on one or several machines); cli.py adds the rest."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from nanoserve.config import QUANTIZATIONS, EngineConfig


def config_default(config_class: type, name: str) -> Any:
    """The default of field `name` of a config dataclass: the CLI keeps no second copy."""
    return {f.name: f.default for f in dataclasses.fields(config_class)}[name]


def add_speed_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        dest="compile_decode",
        action="store_true",
        help="torch.compile the decode step: faster per token on CPU, but it compiles for tens "
        "of seconds (minutes for billion-parameter models on few cores) at start-up, and on "
        "CPU keeps a second copy of the bf16 linear weights",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="int8: weight-only int8 linears (per output channel; activations stay in the model "
        "dtype). FP8 checkpoints (quantization_config in config.json) need no flag",
    )
    parser.add_argument(
        "--no-quantize-lm-head",
        dest="quantize_lm_head",
        action="store_false",
        help="with --quantization, keep the LM head in the model dtype",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="launch every step eagerly: no CUDA graphs on CUDA, no torch.compile on CPU "
        "(even with --compile)",
    )


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int,
        default=config_default(EngineConfig, "tensor_parallel_size"),
        help="split the model across this many worker processes (one per GPU on CUDA; gloo "
        "on CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--nnodes", type=int, default=config_default(EngineConfig, "nnodes"),
        help="machines the tensor-parallel ranks run on (each runs tp / nnodes of them)",
    )  # fmt: skip
    parser.add_argument(
        "--node-rank", type=int, default=config_default(EngineConfig, "node_rank"),
        help="this machine's index; node 0 serves HTTP, the others run with --headless",
    )  # fmt: skip
    parser.add_argument(
        "--master-addr", default=config_default(EngineConfig, "master_addr"),
        help="node 0's address, where the ranks meet",
    )  # fmt: skip
    parser.add_argument(
        "--master-port", type=int,
        help="the port the ranks meet on (required with --nnodes > 1; default: a free port)",
    )  # fmt: skip
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's ranks of an engine whose front is on node 0",
    )
