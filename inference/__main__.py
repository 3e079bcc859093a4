"""``python -m inference``: run the inference worker (``tunefleet inference`` wraps this).

The shared secret comes from ``TUNEFLEET_INFERENCE_SECRET`` (never a command-line
argument, which other local users can read in the process list).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from inference.engine import DEFAULT_TURN_TOKENS
from inference.server import DEFAULT_STALL_LIMIT_S

SECRET_ENV = "TUNEFLEET_INFERENCE_SECRET"
GRACEFUL_SHUTDOWN_S = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--fd", type=int, default=None,
                        help="Serve on this inherited, already listening socket instead of binding --host/--port.")
    parser.add_argument("--max-adapters", type=int, default=8, help="LoRA adapters kept loaded per base model.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    parser.add_argument("--turn-tokens", type=int, default=DEFAULT_TURN_TOKENS,
                        help="Tokens a generation computes per turn before another tenant's gets the model.")
    parser.add_argument("--stall-limit-s", type=float, default=DEFAULT_STALL_LIMIT_S,
                        help="/healthz answers 503 once a generation holds a model this long without a token.")
    args = parser.parse_args(argv)
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        print(f"{SECRET_ENV} must hold the shared secret (16+ characters)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from inference.engine import passive_cpu_threads

    if not passive_cpu_threads() and "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        logging.getLogger(__name__).warning("torch was imported before the worker started: its CPU threads spin")
    import torch
    import uvicorn

    from inference.engine import Engine, InferenceError
    from inference.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    # Imported now, not on the first request: a base model's load then takes its own time only.
    import peft  # noqa: F401
    import transformers  # noqa: F401
    engine = Engine(max_adapters=args.max_adapters, device=args.device, turn_tokens=args.turn_tokens)
    app = create_app(engine, secret, stall_limit_s=args.stall_limit_s)
    stopping = InferenceError(503, "worker_stopping", "The inference worker is stopping; retry.")

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # SIGTERM/SIGINT: end every generation at its next token (their callers get an
            # error event), so open streams close now instead of holding the shutdown.
            engine.cancel_all(stopping)
            super().handle_exit(sig, frame)

    # A stream the generation's end did not close is cut after this many seconds.
    options: dict[str, object] = {"log_level": "warning", "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S}
    if args.fd is None:
        Server(uvicorn.Config(app, host=args.host, port=args.port, **options)).run()
    else:
        import socket

        listener = socket.socket(fileno=args.fd)  # family and type read from the socket itself
        Server(uvicorn.Config(app, **options)).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
