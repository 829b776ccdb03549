"""`tandem serve [MODEL]`: the OpenAI-compatible server, with every engine flag."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tandem.engine.arg_utils import add_engine_args, check_model_arg, engine_kwargs
from tandem.serve.config import (
    AUTO_API_SERVERS_MAX,
    AUTO_CORES_PER_API_SERVER,
    ENGINE_MODES,
    ServeConfig,
)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server over one engine")
    p.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="model dir, .gguf file or architecture name (default: the embedded model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (default: 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: MODEL as given)",
    )
    defaults = ServeConfig()
    p.add_argument(
        "--engine-mode",
        choices=ENGINE_MODES,
        default=defaults.engine_mode,
        help="where the engine runs: a process of its own, or a thread of the server's "
        f"(default: {defaults.engine_mode})",
    )
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=defaults.api_server_count,
        help="API-server processes sharing the port and one engine core: HTTP, tokenization and "
        "streaming then run on that many CPU cores (default: one per "
        f"{AUTO_CORES_PER_API_SERVER} CPU cores, at most {AUTO_API_SERVERS_MAX}, for a CUDA "
        "engine in its own process without --enable-admin-api; else 1)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=defaults.max_waiting_requests,
        help="admission bound in sequences (prompts x n): beyond this many waiting answer 503; "
        f"a request holding more on its own answers 400 (default: {defaults.max_waiting_requests})",
    )
    p.add_argument(
        "--max-request-body-mb",
        type=float,
        default=defaults.max_request_body_mb,
        help="larger request bodies answer 413; /update_weights is exempt "
        f"(default: {defaults.max_request_body_mb:g})",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=defaults.request_read_timeout,
        help="seconds a client may take to send a request's headers, and again its body: slower "
        f"connections are closed (headers) or answered 408 (body) "
        f"(default: {defaults.request_read_timeout:g})",
    )
    p.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="mount /sleep, /wake_up, /update_weights, ... (needs --api-key)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout,
        help="seconds in-flight requests get to finish after SIGTERM "
        f"(default: {defaults.shutdown_timeout:g})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the server's log level (debug also prints the traceback of an error)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log every HTTP request (default: off)")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.executor import device_without_cuda_init
    from tandem.serve.app import build_app
    from tandem.serve.server import bind_socket, print_listening, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"model given twice: {args.model_arg!r} and --model {args.model!r}")
    serve_config = ServeConfig(
        engine_mode=args.engine_mode,
        api_server_count=args.api_server_count,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        max_request_body_mb=args.max_request_body_mb,
        request_read_timeout=args.request_read_timeout,
    )
    if args.tensor_parallel_size > 1:  # ranks would need every add/abort/step mirrored in lockstep
        raise ValueError(
            "tandem serve does not run tensor parallel yet; use --tensor-parallel-size 1"
        )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: {args.port} is not a TCP port; give 1-65535, or 0 for any free one")
    model = args.model_arg or args.model
    check_model_arg(model, args.load_format, "MODEL" if args.model_arg else "--model")
    config = EngineConfig.from_kwargs(**{**engine_kwargs(args), "model": model})
    chat_template = _read_template(args.chat_template)
    if args.enable_admin_api and not args.api_key:
        raise ValueError("--enable-admin-api needs --api-key (or $TANDEM_API_KEY)")
    if args.enable_admin_api and (serve_config.api_server_count or 1) > 1:  # a trainer's calls
        raise ValueError(  # must reach one process: the weight receiver's group lives there
            "--enable-admin-api needs --api-server-count 1 (the admin routes and the weight "
            f"receiver live in one API server), got {serve_config.api_server_count}"
        )
    api_server_count = serve_config.resolved_api_server_count(
        device_without_cuda_init(config.device).type, args.enable_admin_api)
    if args.host not in _LOOPBACK and not args.api_key:
        print(
            f"warning: listening on {args.host} without --api-key: anyone who can reach this "
            "port can use the server",
            file=sys.stderr,
        )
    try:  # before loading the model: fail fast on a busy port
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    served_model_name = args.served_model_name or model or DEFAULT_MODEL_NAME
    if api_server_count > 1:
        from tandem.serve.api_servers import APIServerArgs, run_api_servers

        server_args = APIServerArgs(
            served_model_name=served_model_name,
            api_key=args.api_key,
            chat_template=chat_template,
            model_root=model,
            max_waiting_requests=serve_config.max_waiting_requests,
            shutdown_timeout=serve_config.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
            max_body_bytes=serve_config.max_body_bytes,
            read_timeout=serve_config.request_read_timeout,
        )
        code = run_api_servers(config, sock, api_server_count, server_args)
        print("tandem serve: stopped", flush=True)
        return code
    llm = AsyncLLM.from_config(
        config,
        max_waiting_requests=serve_config.max_waiting_requests,
        engine_mode=serve_config.engine_mode,
    )
    try:
        app = build_app(
            llm,
            served_model_name,
            api_key=args.api_key,
            enable_admin_api=args.enable_admin_api,
            chat_template=chat_template,
            model_root=model,
            max_body_bytes=serve_config.max_body_bytes,
            body_timeout_s=serve_config.request_read_timeout,
        )
        print_listening(sock)
        code = serve(
            app,
            sock,
            llm=llm,
            shutdown_timeout_s=serve_config.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
            read_timeout_s=serve_config.request_read_timeout,
        )
    finally:
        llm.shutdown()
    if code:
        print(f"tandem serve: {llm._error}; exiting {code}", file=sys.stderr, flush=True)
        return code
    print("tandem serve: stopped", flush=True)
    return 0


def _read_template(value: str | None) -> str | None:
    if value is None or "{" in value:
        return value
    if not os.path.isfile(value):
        raise ValueError(f"--chat-template: {value!r} is neither a template nor a file")
    with open(value, encoding="utf-8") as f:
        return f.read()
