"""Orbax checkpoints of the train state and the data iterator, with automatic resume."""
