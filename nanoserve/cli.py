"""The `nanoserve` command line. `nanoserve serve --model M` runs the OpenAI-compatible server.

Each subcommand registers its own parser in `build_parser`; more (chat, bench) plug in the same
way.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

logger = logging.getLogger("nanoserve")

DEMO_MODEL_DIR = Path(__file__).parent / "assets" / "demo"

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


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already explains it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if "default" in help_text or default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return help_text
        return f"{help_text} (default: %(default)s)"


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    from nanoserve.chat_client import add_chat_parser as add_parser

    add_parser(subparsers)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API with SSE "
        "streaming. The HTTP front runs in this process; the model runs in a worker process.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument(
        "--model",
        help="checkpoint directory or Hugging Face hub id (e.g. Qwen/Qwen3-1.7B); default: the "
        "small demo model shipped in the package (a toy that completes Python code)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="name(s) clients use in the `model` field; the first is reported in responses "
        "(default: the --model value)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("NANOSERVE_API_KEY"),
        help="require 'Authorization: Bearer <key>' on /v1/* (default: $NANOSERVE_API_KEY)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="most requests in one running batch"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens in one engine step (default: max(2048, max_model_len))",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        help="bytes for the KV cache, e.g. 4GiB (default on CPU: 2 GiB)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA: fraction of GPU memory for weights + KV cache",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype (auto: the checkpoint's; float16 is bfloat16 on CPU)",
    )  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights from the config (for benchmarks)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random state")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument(
        "--chat-template",
        help="chat template to use instead of the checkpoint's: a Jinja string or a .jinja file",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 503 with Retry-After when this many requests wait for their first token",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not share KV blocks between requests with the same prefix",
    )
    parser.add_argument(
        "--compile",
        dest="compile_decode",
        action="store_true",
        help="torch.compile the decode step: faster per token on CPU, but it compiles for tens "
        "of seconds (minutes for billion-parameter models on few cores) at start-up, and on "
        "CPU keeps a second copy of the bf16 linear weights",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="always the plain eager path, even with --compile",
    )
    parser.add_argument("--num-kv-blocks", type=int, help=argparse.SUPPRESS)  # tests
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before they "
        "are aborted",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level of the server and the worker",
    )
    parser.set_defaults(handler=run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A small LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(subparsers)
    add_chat_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark OpenAI-compatible servers side by side (nanoserve bench --help)",
        add_help=False,
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda args: run_bench(args.bench_args))


def run_bench(bench_args: list[str]) -> int:
    """Run the serving benchmark (nanoserve.bench.serve_bench) with these arguments."""
    from nanoserve.bench.serve_bench import main as bench_main

    return bench_main(bench_args) or 0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from nanoserve.config import EngineConfig
    from nanoserve.engine.loader import resolve_model_path
    from nanoserve.server.app import ServerConfig, create_app
    from nanoserve.server.engine_client import ZmqEngineClient
    from nanoserve.tokenizer import load_tokenizer

    model = args.model or args.model_pos or str(DEMO_MODEL_DIR)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine_config = EngineConfig(
            model=model,
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            seed=args.seed,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            compile_decode=args.compile_decode,
            enforce_eager=args.enforce_eager,
        )
        server_config = ServerConfig(
            model=model,
            served_model_names=tuple(args.served_model_name or [model]),
            api_key=args.api_key or None,
            max_waiting_requests=args.max_waiting_requests,
        )
        # The dummy format needs no download: its directory holds a preset config and tokenizer.
        tokenizer_dir = resolve_model_path(model, args.load_format)
        tokenizer = load_tokenizer(tokenizer_dir, chat_template=args.chat_template)
    except ValueError as e:
        print(f"nanoserve serve: {e}", file=sys.stderr)
        return 2
    client = ZmqEngineClient(engine_config, log_level=args.log_level)
    app = create_app(server_config, client, tokenizer, shutdown_timeout_s=5.0)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            lifespan="on",
        )
    )
    # uvicorn handles SIGINT/SIGTERM (stop intake, grace period, lifespan shutdown), then
    # re-raises the signal under the handlers it found: make those no-ops so we exit with 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    try:
        server.run()
    finally:
        client.kill_now()  # after a forced exit the lifespan shutdown may not have run
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag, --help included, belongs to the benchmark
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
