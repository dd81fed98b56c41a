"""What the client says when its messages cannot be delivered (no broker needed)."""

from confluent_kafka import KafkaError

from processor.client.sow_client import Client


def test_a_flush_that_times_out_names_the_cause_not_the_brokers_being_down():
    client = Client("127.0.0.1:1")
    auth = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed")
    client._remember_error(auth)
    client._remember_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert client._producer_error is auth
    # a later real cause still replaces the earlier one
    refused = KafkaError(KafkaError._TRANSPORT, "Connection refused")
    client._remember_error(refused)
    assert client._producer_error is refused


def test_brokers_down_is_kept_when_nothing_else_was_reported():
    client = Client("127.0.0.1:1")
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
    client._remember_error(down)
    assert client._producer_error is down


def test_close_lets_the_producer_go_and_a_later_publish_makes_a_new_one():
    client = Client("127.0.0.1:1")
    first = client.producer
    client.close()  # nothing queued: the flush returns at once
    assert client._producer is None
    assert client.producer is not first
    client.close()
