"""`python -m slime_async.engine`: serve one embedded engine until SIGTERM/SIGINT.

Owns: the shell entry point only (flags come from `config.add_engine_args`).
Must never import Ray or the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from slime_async.engine.config import add_engine_args, engine_config_from_args
from slime_async.engine.engine import Engine
from slime_async.engine.runner import serve, write_port_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m slime_async.engine",
        description="Embedded inference engine speaking SGLang's HTTP API (CPU or any device).",
    )
    args = add_engine_args(parser).parse_args(argv)
    try:
        cfg = engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def ready(_engine: Engine, port: int) -> None:
            logging.info("serving on http://%s:%d", cfg.host, port)
            if args.port_file:
                write_port_file(args.port_file, port)

        await serve(cfg, stop, on_ready=ready)

    asyncio.run(run())


if __name__ == "__main__":
    main()
