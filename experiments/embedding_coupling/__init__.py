"""The paper's embedding-coupling comparison at one machine's scale (docs/experiments.md)."""
