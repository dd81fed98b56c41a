"""Thin runners: they own the Kafka side and the lifecycle; the engine owns the semantics."""
