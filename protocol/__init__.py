"""What Sluice's processes share: wire messages, socket helpers and component configs."""
