"""What reads a trained run: row lengths the layout accepts, scoring, KV-cache generation, and
the lm-evaluation-harness model."""
