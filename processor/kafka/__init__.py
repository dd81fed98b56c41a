"""Kafka plumbing: client configuration, topics, reading to the end, the worker registry and the
embedded broker."""
