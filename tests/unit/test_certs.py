"""The secured embedded broker's throwaway CA: the server certificate verifies for its hosts only."""

from __future__ import annotations

import datetime
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from processor.kafka.certs import make_server_tls


def _verify(tls, subject) -> None:
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    leaf, *chain = x509.load_pem_x509_certificates(tls.keystore.read_bytes())
    verifier = PolicyBuilder().store(Store([ca])).time(datetime.datetime.now(datetime.UTC)).build_server_verifier(subject)
    verifier.verify(leaf, chain)


def test_server_certificate_is_signed_for_its_hosts(tmp_path):
    tls = make_server_tls(tmp_path, hosts=("127.0.0.1", "localhost"))
    _verify(tls, x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    _verify(tls, x509.DNSName("localhost"))
    with pytest.raises(VerificationError):
        _verify(tls, x509.DNSName("kafka.example.com"))


def test_keystore_holds_the_key_first_and_is_private(tmp_path):
    tls = make_server_tls(tmp_path)
    text = tls.keystore.read_text()
    assert text.startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8, what Kafka's PEM key store reads
    assert text.count("BEGIN CERTIFICATE") == 2
    assert stat.S_IMODE(tls.keystore.stat().st_mode) == 0o600
