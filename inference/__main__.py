"""``python -m inference``: run the inference worker (``tunefleet inference`` wraps this).

The shared secret comes from ``TUNEFLEET_INFERENCE_SECRET`` (never a command-line
argument, which other local users can read in the process list).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

SECRET_ENV = "TUNEFLEET_INFERENCE_SECRET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--fd", type=int, default=None,
                        help="Serve on this inherited, already listening socket instead of binding --host/--port.")
    parser.add_argument("--max-adapters", type=int, default=8, help="LoRA adapters kept loaded per base model.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    args = parser.parse_args(argv)
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        print(f"{SECRET_ENV} must hold the shared secret (16+ characters)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    from inference.engine import Engine
    from inference.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    # Imported now, not on the first request: a base model's load then takes its own time only.
    import peft  # noqa: F401
    import transformers  # noqa: F401
    app = create_app(Engine(max_adapters=args.max_adapters, device=args.device), secret)
    if args.fd is None:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    else:
        import socket

        listener = socket.socket(fileno=args.fd)  # family and type read from the socket itself
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
