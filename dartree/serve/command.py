"""`dartree serve`: its options and the uvicorn server (the serve extra: starlette, uvicorn).

The decoder is built by `dartree.cli.build_decoder` from the same model and decoder options as
`dartree generate`, so a request gives the tokens `dartree generate` gives for the same prompt and
settings (a request without a seed samples with --seed, as generate does).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from ..cli import add_decoder_options, add_model_options, build_decoder
from .schema import MAX_BODY_BYTES

API_KEY_ENV = "DARTREE_API_KEY"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `dartree serve` to an argparse subparsers object; its handler is `args.run(args)`."""
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat and completions, streamed or not)",
        description="Serve one model over OpenAI's HTTP API: POST /v1/chat/completions, POST "
                    "/v1/completions (stream: true for server-sent events), GET /v1/models, GET "
                    "/health. One decoder answers the requests one at a time in arrival order; "
                    "the model and decoder options are those of `dartree generate`, with the "
                    "same defaults, so the same prompt and settings give the same tokens.")
    add_model_options(p)
    add_decoder_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait while one decodes; past that a request gets 429 "
                        "with Retry-After (default: 16)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on every request (401 otherwise; "
                        f"default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of requests that send none (default: 0, as `dartree "
                        "generate`); the same request and seed give the same tokens")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {MAX_BODY_BYTES})")
    p.set_defaults(run=_serve)
    return p


def model_id(args) -> str:
    """The name the model is served under: --model's, or the --target folder's (or file's)."""
    if not args.target:
        return args.model
    name = Path(args.target.rstrip("/\\")).name
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def _serve(args) -> int:
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise SystemExit(f"error: dartree serve needs starlette and uvicorn ({exc}): "
                         f"pip install 'starlette==1.10.0' 'uvicorn==0.54.0', or dartree[serve]")
    for name, value in (("--max-queue", args.max_queue), ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= args.port < 1 << 16:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.seed < 1 << 64:
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    dec, tokenizer = build_decoder(args)
    name = model_id(args)
    app = create_app(dec, tokenizer, name, api_key=args.api_key, max_queue=args.max_queue,
                     max_body_bytes=args.max_body_bytes, default_seed=args.seed)
    print(f"dartree serve: {name} ({args.method}) on http://{args.host}:{args.port}/v1"
          f"{', API key required' if args.api_key else ''}", file=sys.stderr)
    if not _loopback(args.host):
        print(f"dartree serve: warning: {args.host} is reachable from other machines"
              f"{'' if args.api_key else ' and no --api-key is set'}", file=sys.stderr)
    # streams end when the decoder thread stops, after the connections: bound the wait for them
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=5,
                log_level="info" if args.verbose else "warning")
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
