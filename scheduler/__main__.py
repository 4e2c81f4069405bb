"""``python -m scheduler --config '<SchedulerConfig JSON>'``"""

import argparse
import logging
import sys

from protocol.config import SchedulerConfig, from_json
from scheduler.process import run

parser = argparse.ArgumentParser(prog="python -m scheduler")
parser.add_argument("--config", required=True, help="SchedulerConfig as JSON")
config = from_json(SchedulerConfig, parser.parse_args().config)
logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                    format="%(asctime)s %(levelname)s scheduler: %(message)s")
sys.exit(run(config))
