"""The training loop's parts: config validation, optimizer, sharded state and step, logging."""
