"""`nanoserve serve`'s flags for HTTP (address, key, limits, timeouts), speed (compile, eager,
quantization) and parallelism (tensor-parallel ranks on one or several machines); cli.py adds
the model and engine-limit flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Any

from nanoserve.client.prefix_router import ROUTINGS
from nanoserve.common.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from nanoserve.common.protocol import DEFAULT_WORKER_TIMEOUT_S
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.server.config import ServerConfig

_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SIZE_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or '1073741824' -> a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MB)")
    try:
        value = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be > 0 bytes, got {text!r}")
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """A byte count as --help shows it: 33554432 -> '32MiB' (exact binary units only)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535 (argparse's `type` for --port and --master-port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535, got {text!r}")
    return port


def quantization_method(text: str) -> str:
    """--quantization's value; FP8 gets a hint, as FP8 checkpoints need no flag."""
    if text.lower() == "fp8":
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(QUANTIZATIONS)}); an FP8 checkpoint "
            "(a quantization_config in its config.json) needs no flag"
        )
    return text


def config_default(config_class: type, name: str) -> Any:
    """The default of field `name` of a config dataclass: the CLI keeps no second copy."""
    return {f.name: f.default for f in dataclasses.fields(config_class)}[name]


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="name(s) clients use in the `model` field; the first is reported in responses "
        "(default: the --model value)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("NANOSERVE_API_KEY"),
        help="require 'Authorization: Bearer <key>' on every path under /v1 (default: "
        "$NANOSERVE_API_KEY)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat template (as text, never a path)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 503 with Retry-After when this many engine requests (prompts x n) wait "
        "for their first token",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish on SIGINT/SIGTERM; then streams "
        "end with an error frame and [DONE], and the worker gets as long again to exit",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level of the server and the worker",
    )
    add_cors_and_load_flags(parser)
    add_playground_flags(parser)
    add_limit_and_timeout_flags(parser)


def json_string_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take them: '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(
            f"not a JSON list of strings: {text!r} (e.g. '[\"https://app.example\"]' or '[\"*\"]')"
        )
    return value


def add_cors_and_load_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags (every origin by default) and its server-load tracking."""
    for flag, field, what in (
        ("--allowed-origins", "allowed_origins", "origins a browser page may call the API from"),
        ("--allowed-methods", "allowed_methods", "HTTP methods those pages may use"),
        ("--allowed-headers", "allowed_headers", "request headers those pages may send"),
    ):
        default = list(config_default(ServerConfig, field))
        parser.add_argument(
            flag,
            type=json_string_list,
            default=default,
            help=f"{what}, as a JSON list (CORS; default: {json.dumps(default)}, any)",
        )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let those pages send cookies and HTTP authentication",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count the requests in flight on the generation routes for GET /load "
        "(without it /load answers 0, as in vLLM)",
    )


def playground_peer(text: str) -> tuple[str, str]:
    """NAME=URL, e.g. vllm=http://127.0.0.1:8001 (the URL without /v1)."""
    name, sep, url = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"not NAME=URL: {text!r} (e.g. vllm=http://127.0.0.1:8001)"
        )
    return name.strip(), url.strip().rstrip("/").removesuffix("/v1")


def add_playground_flags(parser: argparse.ArgumentParser) -> None:
    """The page at / and the request timelines it draws."""
    parser.add_argument(
        "--disable-playground",
        action="store_true",
        help="serve no page at / (and no timelines, unless --enable-request-timeline)",
    )
    parser.add_argument(
        "--playground-peer",
        type=playground_peer,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another OpenAI-compatible server the playground races against, reached through "
        "this one (repeatable)",
    )
    parser.add_argument(
        "--enable-request-timeline",
        action="store_true",
        help="record every request's timeline (GET /v1/requests/{id}/timeline; the last 100 "
        "requests are kept); without it only the playground's requests are recorded",
    )


def add_limit_and_timeout_flags(parser: argparse.ArgumentParser) -> None:
    max_body_bytes = config_default(ServerConfig, "max_body_bytes")
    parser.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=max_body_bytes,
        help=f"largest request body, e.g. 64MiB (413 beyond; default: "
        f"{format_bytes(max_body_bytes)})",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        help="longest prompt text, checked before tokenizing (400 beyond; default: what "
        "max_model_len tokens of the vocabulary's longest token could hold)",
    )
    for flag, field, what in (
        ("--header-timeout", "header_timeout_s", "a connection's request line and headers"),
        ("--body-timeout", "body_timeout_s", "a request's body, once its headers are in (408)"),
        (
            "--send-timeout",
            "send_timeout_s",
            "a client that reads nothing while its send "
            "buffer is full; then it is disconnected and its requests aborted",
        ),
    ):
        parser.add_argument(
            flag,
            type=float,
            default=config_default(ServerConfig, field),
            help=f"seconds allowed for {what}",
        )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=DEFAULT_WORKER_TIMEOUT_S,
        help="seconds without a heartbeat from the model worker before it is deemed hung: "
        "in-flight requests end with an error and the worker is killed and restarted",
    )


def add_speed_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        dest="compile_decode",
        action="store_true",
        help="CPU: run decode steps under torch.compile instead of through the C++ kernels; it "
        "compiles for tens of seconds at start-up (minutes for billion-parameter models on few "
        "cores)",
    )
    parser.add_argument(
        "--quantization",
        type=quantization_method,
        choices=QUANTIZATIONS,
        help="int8: weight-only int8 linears (per output channel; activations stay in the model "
        "dtype). FP8 checkpoints (quantization_config in config.json) need no flag (default: "
        "none, the model dtype)",
    )
    parser.add_argument(
        "--no-quantize-lm-head",
        dest="quantize_lm_head",
        action="store_false",
        help="with --quantization, keep the LM head in the model dtype",
    )
    parser.add_argument(
        "--speculative-config",
        type=speculative_config,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, '
        '{"method": "suffix"}, or a draft model with the same tokenizer: {"model": DIR_OR_ID, '
        '"num_speculative_tokens": 4}. Drafts are verified in one pass; greedy output is '
        "unchanged and sampled output keeps the model's distribution (default: off)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=config_default(EngineConfig, "kv_cache_dtype"),
        help="how the KV cache stores keys and values: auto (the model dtype), or fp8 (= "
        "fp8_e4m3) / fp8_e5m2, one byte a value with a scale per layer for K and for V (the "
        "checkpoint's k_scale/v_scale, else 1.0, or measured with --calculate-kv-scales): twice "
        "the tokens in the same memory",
    )
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="with an fp8 KV cache and no scales in the checkpoint: each layer's K and V scales "
        "from the first prompt step of 32 tokens or more (|max| / 200 for K, / 100 for V, as "
        "vLLM), instead of 1.0",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="launch every step eagerly: no CUDA graphs on CUDA, no torch.compile on CPU "
        "(even with --compile)",
    )


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON (vLLM's keys), checked now: a bad one is a one-line error."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=config_default(EngineConfig, "tensor_parallel_size"),
        help="split the model across this many worker processes (one per GPU on CUDA; gloo on CPU)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture-of-experts models: place whole experts on the tensor-parallel ranks "
        "instead of a slice of every expert on each",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=config_default(EngineConfig, "data_parallel_size"),
        help="run this many independent engines (each with its own copy of the model and KV "
        "cache, each tensor parallel if asked) behind one front, on this machine",
    )
    parser.add_argument(
        "--data-parallel-routing",
        choices=ROUTINGS,
        default="prefix",
        help="how a request's engine is chosen: prefix (the engine that saw the prompt's "
        "longest prefix, unless it is much busier; else the least loaded), least-loaded, or "
        "round-robin",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=config_default(EngineConfig, "nnodes"),
        help="machines the tensor-parallel ranks run on (each runs tp / nnodes of them)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=config_default(EngineConfig, "node_rank"),
        help="this machine's index; node 0 serves HTTP, the others run with --headless",
    )
    parser.add_argument(
        "--master-addr",
        default=config_default(EngineConfig, "master_addr"),
        help="node 0's address, where the ranks meet",
    )
    parser.add_argument(
        "--master-port",
        type=port_number,
        help="the port the ranks meet on (required with --nnodes > 1; default: a free port)",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's ranks of an engine whose front is on node 0",
    )
