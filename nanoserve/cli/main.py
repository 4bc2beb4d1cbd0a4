"""The `nanoserve` command line: `serve` (the OpenAI-compatible server), `chat` and `bench`.

Each subcommand registers its own parser in `build_parser`. `serve` takes its defaults from the
config dataclasses (`EngineConfig`, `ServerConfig`) and validates every setting, resolves the
checkpoint (config and tokenizer only: the worker reads the weights) and reads its config.json
before a worker starts, so a bad setting is one line on stderr and exit code 2. This module and
everything it imports for `serve` stay out of `nanoserve.core`: the front never loads the model
code.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any

from nanoserve import __version__
from nanoserve.cli.argument_errors import OneLineArgumentParser
from nanoserve.cli.help_format import DefaultsHelpFormatter
from nanoserve.cli.model_arguments import add_hub_flags, check_model_arguments
from nanoserve.cli.serve_flags import (
    add_http_flags,
    add_parallel_flags,
    add_speed_flags,
    config_default,
    parse_bytes,
)
from nanoserve.common.checkpoint import DEMO_MODEL_NAME
from nanoserve.common.config import DTYPES, LOAD_FORMATS, EngineConfig
from nanoserve.server.config import ServerConfig

logger = logging.getLogger("nanoserve")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API with SSE "
        "streaming. The HTTP front runs in this process; the model runs in a worker process.",
        formatter_class=DefaultsHelpFormatter,
    )
    _add_model_flags(parser)
    add_http_flags(parser)
    _add_limit_flags(parser)
    add_speed_flags(parser)
    add_parallel_flags(parser)
    parser.set_defaults(handler=run_serve, command_parser=parser)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument(
        "--model",
        help=f"checkpoint directory or Hugging Face hub id (e.g. Qwen/Qwen3-1.7B); default: "
        f"{DEMO_MODEL_NAME}, the small demo model shipped in the package (a toy that completes "
        "Python code)",
    )
    parser.add_argument(
        "--dtype",
        default=config_default(EngineConfig, "dtype"),
        choices=["auto", *DTYPES],
        help="weight and activation dtype (auto: the checkpoint's, except that a float32 "
        "checkpoint runs in bfloat16 where the device has bf16, as vLLM does, and a float16 one "
        "in bfloat16 on CPU; an explicit float16 stays float16, slow on CPU)",
    )
    add_hub_flags(parser)
    parser.add_argument(
        "--device", default=config_default(EngineConfig, "device"), help="auto, cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--load-format",
        default=config_default(EngineConfig, "load_format"),
        choices=LOAD_FORMATS,
        help="auto or safetensors: the checkpoint's *.safetensors weights; dummy: random weights "
        "from the config (benchmarks)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=config_default(EngineConfig, "seed"),
        help="seed of the engine's random state",
    )
    parser.add_argument(
        "--chat-template",
        help="a chat template (a Jinja string or a .jinja file) to use instead of the "
        "checkpoint's (default: the checkpoint's own)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="where the sampling fields a request leaves unset come from: 'auto', the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, the penalties and "
        "max_new_tokens, as vLLM does); 'vllm', OpenAI's values; or a directory holding a "
        "generation_config.json (default: auto)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        help="how the model writes tool calls (hermes: Qwen2.5/Qwen3 and Hermes <tool_call>; "
        "llama3_json: Llama 3.x JSON; mistral: [TOOL_CALLS]), for tool_choice auto (default: none)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto", the default when a '
        "request has tools); needs --tool-call-parser",
    )


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=config_default(EngineConfig, "max_num_seqs"),
        help="most requests in one running batch",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens in one engine step (default: max(2048, max_model_len))",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        help="CPU: bytes for the KV cache, e.g. 4GiB (default: what --max-num-seqs sequences of "
        "--max-model-len tokens need, at most 2 GiB; on CUDA --gpu-memory-utilization decides)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=config_default(EngineConfig, "gpu_memory_utilization"),
        help="on CUDA: fraction of GPU memory for weights + KV cache",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=config_default(EngineConfig, "block_size"),
        help="tokens per KV-cache block (a power of two)",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not share KV blocks between requests with the same prefix",
    )
    parser.add_argument("--num-kv-blocks", type=int, help=argparse.SUPPRESS)  # tests


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    from nanoserve.cli.chat import add_chat_parser as add_parser

    add_parser(subparsers)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark OpenAI-compatible servers side by side (nanoserve bench --help)",
        add_help=False,
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda args: run_bench(args.bench_args), command_parser=parser)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="nanoserve", description="A small LLM inference server.")
    parser.add_argument("--version", action="version", version=f"nanoserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_parser(subparsers)
    add_chat_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def run_bench(bench_args: list[str]) -> int:
    """Run the serving benchmark (nanoserve.bench.serve_bench) with these arguments."""
    from nanoserve.bench.serve_bench import main as bench_main

    return bench_main(bench_args) or 0


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The engine's settings from `serve`'s flags (ValueError names a bad one)."""
    return EngineConfig(
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
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        compile_decode=args.compile_decode,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        data_parallel_size=args.data_parallel_size,
        revision=args.revision,
        download_dir=args.download_dir,
    )


def check_engine_config(config: EngineConfig) -> Path:
    """Check the device, resolve the checkpoint (no weights) and check the limits against its
    config.json.

    Returns the checkpoint directory, whose tokenizer the front loads. Raises ValueError.
    """
    from nanoserve.cli.startup import check_device, check_kv_cache_memory
    from nanoserve.common.checkpoint import load_model_config, resolve_checkpoint

    check_device(config.device)
    model_dir = resolve_checkpoint(
        config.model,
        config.load_format,
        with_weights=False,
        revision=config.revision,
        download_dir=config.download_dir,
    )
    model_config = load_model_config(model_dir)
    max_model_len = config.resolve_max_model_len(model_config)
    config.scheduler_config(max_model_len)  # the batch limits against that length
    check_kv_cache_memory(config, model_config)
    spec = config.speculative_config
    if spec is not None and spec.model is not None:
        draft_dir = resolve_checkpoint(spec.model, config.load_format, with_weights=False)
        draft_vocab = load_model_config(draft_dir).vocab_size
        if draft_vocab != model_config.vocab_size:
            raise ValueError(
                f"the draft model {spec.model} has {draft_vocab} tokens in its vocabulary, the "
                f"model {model_config.vocab_size}: a draft model must share the tokenizer"
            )
    return model_dir


def server_config_from_args(args: argparse.Namespace, model: str, model_dir: Path) -> ServerConfig:
    """The HTTP front's settings from `serve`'s flags (ValueError names a bad one)."""
    if not args.worker_timeout > 0:
        raise ValueError(f"--worker-timeout must be > 0 seconds, got {args.worker_timeout}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be ≥ 0 seconds, got {args.shutdown_timeout}")
    return ServerConfig(
        model=model,
        served_model_names=tuple(args.served_model_name or [model]),
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        trust_request_chat_template=args.trust_request_chat_template,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        send_timeout_s=args.send_timeout,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_request_timeline=args.enable_request_timeline,
        enable_playground=not args.disable_playground,
        playground_peers=tuple(args.playground_peer),
        default_sampling=generation_defaults(args.generation_config, model_dir),
    )


def generation_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """--generation-config: the sampling defaults of `model_dir` (auto), none (vllm), or those
    of the directory named; checked here, so that a bad one stops start-up, not requests."""
    from nanoserve.common.checkpoint import load_generation_defaults
    from nanoserve.common.sampling_params import SamplingParams

    if source == "vllm":
        return {}
    directory = model_dir if source == "auto" else Path(source)
    if source != "auto" and not directory.is_dir():
        raise ValueError(f"--generation-config {source}: not a directory (or auto, or vllm)")
    defaults = load_generation_defaults(directory)
    SamplingParams(**defaults)  # ValueError names a field out of range
    return defaults


def run_serve(args: argparse.Namespace) -> int:
    model = args.model or args.model_pos or DEMO_MODEL_NAME
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.trust_remote_code:
        logger.warning(
            "--trust-remote-code has no effect: nanoserve runs its own model code for the "
            "supported architectures and never code from a checkpoint"
        )
    try:
        engine_config = engine_config_from_args(args, model)
        model_dir = check_engine_config(engine_config)  # before torch or transformers load
        if args.headless:  # no HTTP here: this node only runs its ranks
            from nanoserve.client.headless import run_headless

            return run_headless(engine_config, args.log_level)
        server_config = server_config_from_args(args, model, model_dir)
        from nanoserve.cli.startup import bind_socket

        sock = bind_socket(args.host, args.port)  # a busy port is reported now, not after loading
    except ValueError as e:
        print(f"nanoserve serve: {with_flag_names(str(e))}", file=sys.stderr)
        return 2
    if server_config.default_sampling:
        logger.warning(
            "sampling fields a request leaves unset take the model's generation config: %s "
            "(--generation-config vllm turns this off)",
            dict(server_config.default_sampling),
        )
    from nanoserve.client.data_parallel import make_engine_client

    client = make_engine_client(
        engine_config, args.log_level, args.worker_timeout, args.data_parallel_routing
    )
    client.launch()  # the worker loads the model while this process loads the tokenizer
    try:
        try:
            tokenizer = _load_front_tokenizer(args, model_dir)
        except ValueError as e:
            print(f"nanoserve serve: {with_flag_names(str(e))}", file=sys.stderr)
            return 2
        return _run_server(args, client, server_config, tokenizer, sock)
    finally:
        client.kill_now()  # after a forced exit the lifespan shutdown may not have run
        sock.close()


def _load_front_tokenizer(args: argparse.Namespace, model_dir: Path):
    """The tokenizer and chat template the front serves with (--tokenizer, or the model's)."""
    from nanoserve.common.checkpoint import resolve_tokenizer
    from nanoserve.text.tokenizer import load_tokenizer

    if args.tokenizer:
        model_dir = resolve_tokenizer(args.tokenizer, args.download_dir)
    return load_tokenizer(model_dir, chat_template=args.chat_template)


# EngineConfig fields whose flag is not the field's name with dashes.
_FLAG_NAMES = {"compile_decode": "--compile", "enable_prefix_caching": "--no-enable-prefix-caching"}


def with_flag_names(message: str) -> str:
    """A config error with each EngineConfig and ServerConfig field (those with an underscore,
    which no English word has) named by its command-line flag (seconds drop their `_s`)."""
    for field in (*dataclasses.fields(EngineConfig), *dataclasses.fields(ServerConfig)):
        if "_" not in field.name:
            continue
        flag = _FLAG_NAMES.get(field.name, "--" + field.name.removesuffix("_s").replace("_", "-"))
        message = re.sub(rf"(?<![\w-]){field.name}\b", flag, message)
    # A one-word field with its value in quotes: "device 'cuda'" -> "--device cuda".
    return re.sub(r"(?<![\w-])(device|dtype) '([^']*)'", r"--\1 \2", message)


def _run_server(args: argparse.Namespace, client, server_config, tokenizer, sock) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean shutdown, 2 (bad settings) or 1 if the first
    worker failed to start, 1 if the server never started."""
    import uvicorn

    from nanoserve.server.app import create_app
    from nanoserve.server.http_server import SHUTDOWN_FLUSH_S, GracefulServer, timed_h11_protocol

    grace_s = args.shutdown_timeout
    app = create_app(server_config, client, tokenizer, shutdown_timeout_s=grace_s)
    protocol = timed_h11_protocol(server_config.header_timeout_s, server_config.send_timeout_s)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=protocol,
        timeout_graceful_shutdown=grace_s + SHUTDOWN_FLUSH_S,
        lifespan="on",
    )
    server = GracefulServer(uvicorn_config, on_shutdown=lambda: client.begin_shutdown(grace_s))
    # uvicorn handles SIGINT/SIGTERM (stop intake, grace period, lifespan shutdown), then
    # re-raises the signal under the handlers it found: make those no-ops so we exit with 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    client.on_start_failed = lambda error: setattr(server, "should_exit", True)
    logger.info("listening on http://%s:%d (Ctrl-C stops the server)", args.host, args.port)
    server.run(sockets=[sock])
    if client.start_error is not None:
        print(f"nanoserve serve: {with_flag_names(str(client.start_error))}", file=sys.stderr)
        return 2 if client.start_error.is_config_error else 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag, --help included, belongs to the benchmark
        return run_bench(argv[1:])
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:  # a bare `nanoserve`
        parser.print_help()
        return 0
    if extras:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "serve":
        check_model_arguments(args.command_parser, args, argv[argv.index("serve") + 1 :])
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C before `serve` serves (from then on uvicorn handles it)
        print(f"nanoserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
