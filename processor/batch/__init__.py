"""Spark batch jobs over SOW topics: point-in-time snapshots, replays and SQL (optional `spark` extra)."""
