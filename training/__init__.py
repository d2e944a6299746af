"""The training loop's parts: config validation, optimizer, sharded state and step, logging,
divergence (stop or roll back), and the watcher of a multi-process run's training (supervisor)."""
