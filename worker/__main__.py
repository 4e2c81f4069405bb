"""``python -m worker --config '<WorkerConfig JSON>'``"""

from __future__ import annotations

import argparse
import logging
import sys

from protocol.config import ConfigError, WorkerConfig, from_json


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m worker")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    parser.add_argument("--log-name", default=None, help="what its log lines say they come from (worker[RANK])")
    args = parser.parse_args()
    try:
        config = from_json(WorkerConfig, args.config)
    except (ConfigError, TypeError, ValueError) as e:
        print(f"worker: invalid --config: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {args.log_name or f'worker[{config.rank}]'}: %(message)s")
    from worker.process import run  # imports torch: after the config is known to be valid

    return run(config)


if __name__ == "__main__":
    sys.exit(main())
