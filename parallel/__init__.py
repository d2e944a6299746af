"""Mesh, sharding rules, token layouts and context-parallel (ring) attention."""
