"""`autobucket serve`: arguments -> an `AsyncEngine` on the loaded model -> its OpenAI-compatible server on
127.0.0.1 until interrupted (Ctrl-C aborts what is in flight and stops it).

torch, transformers and the server's packages are imported only by the handler, so registering this
command keeps `autobucket plan` torch-free."""

from __future__ import annotations

import argparse
import sys
import threading

from autobucket.config import KERNELS


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from autobucket.cli.args import add_model_arguments, finish_parser, non_negative_int, positive_int

    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, /generate) on 127.0.0.1",
        description="Serves the model through the asynchronous engine: POST /v1/completions, "
        "/v1/chat/completions, /generate (token ids in and out, with each token's weights version), /abort; "
        "GET /health, /v1/models. Binds the loopback interface only (there is no authentication).",
    )
    add_model_arguments(parser, default="smollm2")
    parser.add_argument("--host", default="127.0.0.1", choices=("127.0.0.1", "localhost", "::1"),
                        help="the loopback address to bind (default 127.0.0.1; there is no authentication)")
    parser.add_argument("--port", type=non_negative_int, default=8000, metavar="P", help="default 8000; 0: a free port")
    parser.add_argument(
        "--kernels",
        choices=KERNELS,
        default="auto",
        help="auto (default: the engine's kernels where they can run the model, else its own "
        "ops), invariant (require the engine's batch-invariant kernels: bitwise logprobs "
        "whatever else is in flight) or torch (the model's own ops)",
    )
    parser.add_argument("--max-batch", type=positive_int, default=32, metavar="N", help="most rows decoded at once")
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="most tokens of a request's prompt and completion (default: min(1024, the model's))",
    )
    parser.add_argument("--served-model-name", default=None, metavar="NAME", help="the id /v1/models lists")
    finish_parser(parser, _run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from autobucket.cli.args import load_model_from_args
    from autobucket.config import RolloutConfig
    from autobucket.serving import AsyncEngine

    model, tokenizer = load_model_from_args(args)
    config = RolloutConfig(kernels=args.kernels)
    with AsyncEngine(model, tokenizer, config, max_batch=args.max_batch, max_model_len=args.max_model_len) as engine:
        server = engine.serve(args.host, args.port, args.served_model_name)
        print(f"autobucket serve: listening on {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.close()
    return 0
