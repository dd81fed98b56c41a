"""Runners: thin adapters that feed Kafka messages to the SOW topic processor and produce its output."""
