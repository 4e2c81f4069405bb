"""``python -m scheduler --config '<SchedulerConfig JSON>'``"""

import argparse
import logging
import sys

from protocol.config import SchedulerConfig, from_json
from scheduler.process import run

parser = argparse.ArgumentParser(prog="python -m scheduler")
parser.add_argument("--config", required=True, help="SchedulerConfig as JSON")
parser.add_argument("--log-name", default="scheduler", help="what its log lines say they come from")
args = parser.parse_args()
config = from_json(SchedulerConfig, args.config)
logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                    format=f"%(asctime)s %(levelname)s {args.log_name}: %(message)s")
sys.exit(run(config))
