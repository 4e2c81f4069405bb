"""``python -m worker --config '<WorkerConfig JSON>'``"""

from __future__ import annotations

import argparse
import logging
import sys

from protocol.config import ConfigError, WorkerConfig, from_json


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m worker")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    try:
        config = from_json(WorkerConfig, parser.parse_args().config)
    except (ConfigError, TypeError, ValueError) as e:
        print(f"worker: invalid --config: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker[{config.rank}]: %(message)s")
    from worker.process import run  # imports torch: after the config is known to be valid

    return run(config)


if __name__ == "__main__":
    sys.exit(main())
