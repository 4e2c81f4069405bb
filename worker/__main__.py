"""``python -m worker --config '<WorkerConfig JSON>'``"""

import argparse
import logging
import sys

from protocol.config import WorkerConfig, from_json
from worker.process import run

parser = argparse.ArgumentParser(prog="python -m worker")
parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
config = from_json(WorkerConfig, parser.parse_args().config)
logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                    format=f"%(asctime)s %(levelname)s worker[{config.rank}]: %(message)s")
sys.exit(run(config))
