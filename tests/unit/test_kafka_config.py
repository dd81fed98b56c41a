"""The deployment's Kafka client settings: parsing, environment, validation, precedence, Spark."""

from __future__ import annotations

import re
import string

import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given
from hypothesis import strategies as st

from processor.contract.errors import ConfigError
from processor.kafka.clients import _client_config, end_offsets
from processor.kafka.config import (
    KafkaConfig,
    env_property,
    kafka_config,
    load_kafka_config,
    parse_properties,
    spark_kafka_options,
    use_kafka_config,
)

SECURED = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "ksow",
    "sasl.password": "s3=cr\"et\\",
}


@pytest.fixture(autouse=True)
def _from_environment():
    """Every test starts (and leaves) with the configuration taken from the environment."""
    use_kafka_config(None)
    yield
    use_kafka_config(None)


def write(tmp_path, text: str):
    path = tmp_path / "client.properties"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ the file


def test_properties_file_lines_comments_and_values_with_equals_signs():
    text = "# a comment\n! another\n\n  security.protocol = SASL_SSL \nsasl.password=a=b=c\n"
    assert parse_properties(text, "f") == [
        ("security.protocol", "SASL_SSL", "f:4"),
        ("sasl.password", "a=b=c", "f:5"),
    ]


def test_names_end_at_the_separators_a_java_client_reads():
    text = "sasl.username: ksow\nsasl.password Hunter2 x\nclient.id\n"
    assert parse_properties(text, "f") == [("sasl.username", "ksow", "f:1"), ("sasl.password", "Hunter2 x", "f:2"), ("client.id", "", "f:3")]


def test_a_byte_order_mark_and_crlf_line_ends_are_not_part_of_the_settings(tmp_path):
    path = tmp_path / "client.properties"
    path.write_bytes("\ufeffclient.id=ksow\r\nsecurity.protocol=plaintext\r\n".encode())
    assert dict(load_kafka_config(path, {}).properties) == {"client.id": "ksow", "security.protocol": "plaintext"}


@pytest.mark.parametrize("line", ["=Hunter2", '"sasl.password"=Hunter2', "[sasl] password Hunter2"])
def test_malformed_line_names_file_and_line_but_never_its_value(line):
    with pytest.raises(ConfigError, match=r"^f:2: expected name=value") as refused:
        parse_properties(f"# ok\n{line}\n", "f")
    assert "Hunter2" not in str(refused.value)


def test_unknown_property_names_the_line_but_not_its_value(tmp_path):
    """A misspelt sasl.password must not print the password."""
    path = write(tmp_path, "security.protocol=SSL\nsasl.pasword=Hunter2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: sasl.pasword: No such configuration property") as refused:
        load_kafka_config(path, {})
    assert "Hunter2" not in str(refused.value)


@pytest.mark.parametrize("text,problem", [
    ("sasl.mechanism=PLAIN\nsasl.username=u\nsasl.password=p\n", re.escape("with no security.protocol (plaintext): set security.protocol to SASL_SSL or SASL_PLAINTEXT")),
    ("security.protocol=SSL\nsasl.mechanism=PLAIN\n", "with security.protocol=ssl"),
    ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nsasl.username=u\nsasl.password=p\nssl.ca.location=probe\n",
     r"ssl.ca.location \(.*:5\) would be ignored with security.protocol=sasl_plaintext"),
])
def test_security_settings_a_protocol_would_ignore_are_refused(tmp_path, text, problem):
    """librdkafka only warns, then connects in the clear without the credentials or the CA."""
    with pytest.raises(ConfigError, match=problem):
        load_kafka_config(write(tmp_path, text), {})


def test_a_file_setting_names_the_file_it_cannot_read(tmp_path):
    path = write(tmp_path, f"security.protocol=SSL\nssl.ca.location={tmp_path}/nowhere.pem\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: ssl.ca.location={tmp_path}/nowhere.pem: the file does not exist$"):
        load_kafka_config(path, {})


def test_invalid_value_names_the_line_and_hides_secrets(tmp_path):
    path = write(tmp_path, "security.protocol=TLS\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: security.protocol=TLS: Invalid value"):
        load_kafka_config(path, {})


def test_settings_that_do_not_work_together_are_refused(tmp_path):
    path = write(tmp_path, "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n")
    with pytest.raises(ConfigError, match="sasl.username and sasl.password must be set"):
        load_kafka_config(path, {})


@pytest.mark.parametrize("name", ["group.id", "transactional.id", "enable.idempotence", "partitioner", "isolation.level"])
def test_settings_ksow_owns_cannot_be_configured(tmp_path, name):
    path = write(tmp_path, f"{name}=x\n")
    with pytest.raises(ConfigError, match=rf"{path}:1: {name} is set by ksow"):
        load_kafka_config(path, {})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load_kafka_config(tmp_path / "nope.properties", {})


def test_bootstrap_servers_is_the_fallback_address_not_a_property(tmp_path):
    path = write(tmp_path, "bootstrap.servers=kafka:9093\nclient.id=ksow-test\n")
    config = load_kafka_config(path, {})
    assert config.bootstrap == "kafka:9093"
    assert dict(config.properties) == {"client.id": "ksow-test"}


# ------------------------------------------------------------------ the environment


def _encode(name: str) -> str:
    """The inverse of env_property, as the Confluent images document it."""
    return "KAFKA_" + name.replace("_", "__").replace("-", "___").replace(".", "_").upper()


segment = st.text(string.ascii_lowercase + string.digits, min_size=1, max_size=6)
names = st.lists(st.tuples(st.sampled_from([".", "_", "-"]), segment), max_size=4).flatmap(
    lambda rest: segment.map(lambda first: first + "".join(sep + part for sep, part in rest))
)


@given(names)
def test_env_names_round_trip(name):
    assert env_property(_encode(name)) == name


def test_env_examples():
    assert env_property("KAFKA_SECURITY_PROTOCOL") == "security.protocol"
    assert env_property("KAFKA_SSL_CA_LOCATION") == "ssl.ca.location"
    assert env_property("KAFKA_LOG__LEVEL") == "log_level"


def test_env_overrides_the_file_and_foreign_variables_are_ignored(tmp_path):
    path = write(tmp_path, "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nsasl.username=file\nsasl.password=p\n")
    env = {"KAFKA_SASL_USERNAME": "env", "KAFKA_BOOTSTRAP": "h:1", "KAFKA_HOME": "/opt/kafka", "KAFKA_HEAP_OPTS": "-Xmx1g"}
    config = load_kafka_config(path, env)
    assert config.properties["sasl.username"] == "env"
    assert config.origins["sasl.username"] == "env KAFKA_SASL_USERNAME"
    assert config.origins["sasl.password"] == f"{path}:4"
    assert "home" not in config.properties and config.bootstrap is None


def test_misspelt_security_variable_is_an_error():
    with pytest.raises(ConfigError, match="^env KAFKA_SASL_USERNAM: No such configuration property"):
        load_kafka_config(None, {"KAFKA_SASL_USERNAM": "x"})


def test_invalid_value_in_env_names_the_variable():
    with pytest.raises(ConfigError, match="^env KAFKA_SECURITY_PROTOCOL: security.protocol=TLS: Invalid value"):
        load_kafka_config(None, {"KAFKA_SECURITY_PROTOCOL": "TLS"})


def test_configuration_in_force_follows_file_and_env(tmp_path, monkeypatch):
    path = write(tmp_path, "client.id=one\n")
    monkeypatch.setenv("KSOW_KAFKA_CONFIG", str(path))
    assert kafka_config().properties["client.id"] == "one"
    monkeypatch.setenv("KAFKA_CLIENT_ID", "two")
    assert kafka_config().properties["client.id"] == "two"
    use_kafka_config(KafkaConfig({"client.id": "three"}))
    assert kafka_config().properties["client.id"] == "three"


def test_describe_masks_secrets():
    text = load_kafka_config(None, {f"KAFKA_{k.upper().replace('.', '_')}": v for k, v in SECURED.items()}).describe()
    assert "sasl.username=ksow" in text and "sasl.password=***" in text and "s3=cr" not in text


# ------------------------------------------------------------------ clients


def test_deployment_settings_override_defaults_and_callers_override_both():
    use_kafka_config(KafkaConfig({"compression.type": "zstd", "client.id": "deploy"}))
    config = _client_config("h:1", {"compression.type": "lz4", "linger.ms": 5}, {"client.id": "worker-1"})
    assert config == {"compression.type": "zstd", "linger.ms": 5, "client.id": "worker-1", "bootstrap.servers": "h:1",
                      "topic.metadata.refresh.interval.ms": 30_000}


def test_clients_refresh_their_topics_metadata_every_30_s_unless_the_deployment_says_otherwise():
    """librdkafka's 5 minutes was how long a worker took to find an input topic deleted under it."""
    assert _client_config("h:1", {}, {})["topic.metadata.refresh.interval.ms"] == 30_000
    use_kafka_config(KafkaConfig({"topic.metadata.refresh.interval.ms": "120000"}))
    assert _client_config("h:1", {}, {})["topic.metadata.refresh.interval.ms"] == "120000"


# ------------------------------------------------------------------ Spark


def test_spark_options_plaintext():
    assert spark_kafka_options("h:1", KafkaConfig()) == {"kafka.bootstrap.servers": "h:1", "kafka.security.protocol": "PLAINTEXT"}


def test_spark_options_scram_over_tls_with_inline_ca(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    options = spark_kafka_options("h:1", KafkaConfig({**SECURED, "ssl.ca.location": str(ca)}))
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="ksow" password="s3=cr\\"et\\\\";'
    )
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.certificates"] == ca.read_text()
    assert options["kafka.ssl.endpoint.identification.algorithm"] == "https"


def test_spark_options_client_certificate_and_no_hostname_check(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("CERT")
    key.write_text("-----BEGIN PRIVATE KEY-----\nK\n-----END PRIVATE KEY-----\n")
    props = {"security.protocol": "SSL", "ssl.certificate.location": str(cert), "ssl.key.location": str(key),
             "ssl.key.password": "kp", "ssl.endpoint.identification.algorithm": "none"}  # fmt: skip
    options = spark_kafka_options("h:1", KafkaConfig(props))
    assert options["kafka.ssl.keystore.type"] == "PEM"
    assert options["kafka.ssl.keystore.certificate.chain"] == "CERT"
    assert options["kafka.ssl.keystore.key"] == key.read_text()
    assert options["kafka.ssl.key.password"] == "kp"
    assert options["kafka.ssl.endpoint.identification.algorithm"] == ""
    assert "kafka.sasl.jaas.config" not in options


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({**SECURED, "sasl.mechanism": "OAUTHBEARER"}, "SASL mechanism OAUTHBEARER is not supported"),
        ({"security.protocol": "SSL", "enable.ssl.certificate.verification": "false"}, "no Java client equivalent"),
        ({"security.protocol": "SSL", "ssl.ca.location": "/no/such/ca.pem"}, "must be a readable PEM file"),
        ({"security.protocol": "SSL", "ssl.certificate.pem": "C", "ssl.key.pem": "-----BEGIN RSA PRIVATE KEY-----"}, "PKCS#8"),
    ],
)
def test_spark_options_refuse_what_the_java_client_cannot_do(props, message):
    with pytest.raises(ConfigError, match=message):
        spark_kafka_options("h:1", KafkaConfig(props))


def test_spark_options_default_to_the_configuration_in_force():
    use_kafka_config(KafkaConfig({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"}))
    assert "PlainLoginModule" in spark_kafka_options("h:1")["kafka.sasl.jaas.config"]


def test_a_continued_line_is_one_setting_and_other_line_breaks_are_not_line_ends(tmp_path):
    """Re-check: a password continued with a backslash, or holding a vertical tab, was read as two
    lines, and the second one's first word was shown in an error."""
    text = "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nsasl.username=u\nsasl.password=abc\\\n    S3CRETcont\n"
    assert parse_properties(text, "f")[-1] == ("sasl.password", "abcS3CRETcont", "f:4")
    assert parse_properties("sasl.password=ab\x0bS3CRET\u2028x\n", "f") == [("sasl.password", "ab\x0bS3CRET\u2028x", "f:1")]
    assert parse_properties("client.id=a\\\\\nsasl.username=u\n", "f") == [("client.id", "a\\\\", "f:1"), ("sasl.username", "u", "f:2")]


def test_an_unknown_name_not_shaped_like_a_property_is_not_shown(tmp_path):
    """A pasted secret on a line of its own reads as a name."""
    with pytest.raises(ConfigError, match=r":1: a name not shaped like a property \(not shown") as refused:
        load_kafka_config(write(tmp_path, "S3CRETalone\n"), {})
    assert "S3CRET" not in str(refused.value)


def test_passphrases_and_oauthbearer_settings_are_masked_but_not_the_token_endpoint():
    config = KafkaConfig({"sasl.oauthbearer.assertion.private.key.passphrase": "S1", "sasl.oauthbearer.config": "principal=a extension_k=S2",
                          "sasl.oauthbearer.client.secret": "S3", "sasl.oauthbearer.token.endpoint.url": "https://idp.example.com/token"})
    text = config.describe()
    assert not any(s in text for s in ("S1", "S2", "S3")) and "https://idp.example.com/token" in text


def test_an_identity_provider_that_cannot_be_reached_is_an_outage_not_a_refusal():
    """Re-check: OAUTHBEARER's token endpoint down made `reach` say the cluster refused the client
    (exit 4: a pool stopped for good) though no broker was asked."""
    import time

    from processor.kafka.clients import KafkaRefused, KafkaUnreachable, reach

    config = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc",
              "sasl.oauthbearer.client.id": "ksow", "sasl.oauthbearer.client.secret": "s",
              "sasl.oauthbearer.token.endpoint.url": "http://127.0.0.1:1/token"}
    use_kafka_config(load_kafka_config(None, {f"KAFKA_{k.upper().replace('.', '_')}": v for k, v in config.items()}))
    try:
        began = time.monotonic()
        with pytest.raises(KafkaUnreachable) as unreachable:
            reach("127.0.0.1:1", 3)
        assert not isinstance(unreachable.value, KafkaRefused) and time.monotonic() - began < 10
    finally:
        use_kafka_config(None)


_COMPACTED = {"t.sow": (4, {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"}), "t.diff": (4, {})}


@pytest.mark.parametrize("found, refused", [
    ({"cleanup.policy": "compact"}, False),
    ({"cleanup.policy": "compact,delete", "retention.ms": "-1", "retention.bytes": "-1"}, False),  # nothing removed by time or size
    ({"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}, False),  # never compacted, but nothing lost
    ({"cleanup.policy": "delete", "retention.ms": "604800000", "retention.bytes": "-1"}, True),
    ({"cleanup.policy": "compact,delete", "retention.ms": "604800000", "retention.bytes": "-1"}, True),
    ({"cleanup.policy": "delete, compact", "retention.ms": "-1", "retention.bytes": "1073741824"}, True),
])
def test_a_changelog_that_removes_records_by_time_or_size_is_refused_with_the_fix(found, refused):
    """A `.sow` someone created with time retention loses the records older than it: a store rebuilt
    from it would lose them too, with no error (Kafka Streams refuses such changelogs)."""
    from processor.kafka.clients import check_compaction

    configs = {"t.sow": found, "t.diff": {"cleanup.policy": "delete", "retention.ms": "1000"}}  # .diff may age out
    if not refused:
        check_compaction(_COMPACTED, configs)
        return
    with pytest.raises(ConfigError, match=r"^topic t\.sow has cleanup\.policy=.*--entity-name t\.sow --add-config cleanup\.policy=compact\)$"):
        check_compaction(_COMPACTED, configs)


def test_a_changelog_whose_configuration_could_not_be_read_is_not_refused():
    from processor.kafka.clients import check_compaction

    check_compaction(_COMPACTED, {})


class _ElectingConsumer:
    """A consumer whose topic is still electing leaders: the first reads of each partition fail."""

    def __init__(self, failures: int, error: int):
        self.failures, self.error, self.calls = failures, error, 0

    def get_watermark_offsets(self, tp, timeout=None):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise KafkaException(KafkaError(self.error))
        return (0, 10 + tp.partition)


def test_end_offsets_waits_out_the_leader_election_of_a_new_topic():
    consumer = _ElectingConsumer(failures=2, error=KafkaError.NOT_LEADER_FOR_PARTITION)
    assert end_offsets(consumer, "t", [0, 1]) == {0: (0, 10), 1: (0, 11)}
    assert consumer.calls == 4


def test_end_offsets_does_not_retry_a_refusal():
    consumer = _ElectingConsumer(failures=1, error=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        end_offsets(consumer, "t", [0])
    assert consumer.calls == 1
