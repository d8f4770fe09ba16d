"""Entry point of an async RL run: `python train_async.py [flags]` (see `--help`, README.md).

Parses and validates the flags (`slime_async.config`), then hands the run to the controller. A
run that stops for a reason (a lost trainer rank or node, no engine left) prints it in one line
and exits with status 3 within a bound (`slime_async.orchestrator.stop`).
"""

from __future__ import annotations

import asyncio
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from slime_async.host import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread: the driver's threads share two heaps
    from slime_async.config import parse_config
    from slime_async.orchestrator.controller import train

    # before parsing: a GGUF --hf-checkpoint is converted (and says so) while the flags are read
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpx2"):  # the `openai` client's HTTP stack: a line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from slime_async.orchestrator.node_loss import TrainerLostError
    from slime_async.orchestrator.node_paths import NodePathError
    from slime_async.orchestrator.stop import StopWatchdog
    from slime_async.orchestrator.supervisor import EnginesDownError

    cfg = parse_config(argv)
    stop = StopWatchdog()
    try:
        summary = asyncio.run(train(cfg, on_stop=stop.arm))
    except (TrainerLostError, NodePathError, EnginesDownError) as e:  # the reason is the message
        stop.arm(str(e))  # said once, however the stop was found
        stop.exit()  # status 3, whatever a survivor's thread is blocked in
    keys = ("rollout/reward", "eval/reward", "accounting/consumed", "accounting/dropped")
    print("done:", {k: round(float(summary[k]), 4) for k in keys if k in summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
