"""The embedded Apache Kafka broker (KRaft), so ksow runs and tests without Docker."""

from processor.broker.embedded import BrokerError, EmbeddedKafka, kafka_jars, run_foreground

__all__ = ["BrokerError", "EmbeddedKafka", "kafka_jars", "run_foreground"]
