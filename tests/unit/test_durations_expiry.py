"""Durations and lifetime resolution (AMPS per-message lifetimes, Artemis clamps)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.core.durations import MAX_DURATION_MS, DurationError, format_duration_ms, parse_duration_ms
from processor.core.expiry import ExpirationMode, ExpiryPolicy, is_due


@pytest.mark.parametrize("text,ms", [("500ms", 500), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000), ("1d", 86_400_000), ("10", 10_000), ("1.5", 1500), (2, 2000), (" 3s ", 3000), ("0", 0)])
def test_parse(text, ms):
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "abc", "5x", "-1s", "1s2", True, -3, [1], b"5s", None])
def test_parse_rejects(text):
    with pytest.raises(DurationError):
        parse_duration_ms(text)


@pytest.mark.parametrize("text", ["36501d", "200000000000d", "9" * 400, "3153600001", 1e300, float("inf")])
def test_durations_over_about_100_years_are_refused(text):
    with pytest.raises(DurationError, match="over the limit of 36500d"):
        parse_duration_ms(text)


def test_the_longest_duration_fits_an_instant_in_64_bits():
    assert parse_duration_ms("36500d") == MAX_DURATION_MS
    assert 2**62 // MAX_DURATION_MS > 1000  # far from overflowing with any wall clock added


@pytest.mark.parametrize("text", [float("nan"), "x" * 10_000])
def test_errors_do_not_echo_huge_input(text):
    with pytest.raises(DurationError) as err:
        parse_duration_ms(text)
    assert len(str(err.value)) < 120


@given(st.integers(0, 10**10))
def test_format_round_trip(ms):
    assert parse_duration_ms(format_duration_ms(ms)) == ms


DEFAULT_30S = ExpiryPolicy(ExpirationMode.DEFAULT, 30_000)


def test_topic_default_and_message_override():
    assert DEFAULT_30S.lifetime_ms(None) == 30_000
    assert DEFAULT_30S.lifetime_ms(5_000) == 5_000
    assert DEFAULT_30S.lifetime_ms(0) is None  # 0 = never expires
    assert DEFAULT_30S.expires_at(1_000, None) == 31_000


def test_enabled_expires_only_message_lifetimes():
    policy = ExpiryPolicy(ExpirationMode.ENABLED)
    assert policy.active
    assert policy.lifetime_ms(None) is None
    assert policy.lifetime_ms(2_000) == 2_000


def test_disabled_still_stores_message_lifetimes_but_is_not_active():
    policy = ExpiryPolicy(ExpirationMode.DISABLED)
    assert not policy.active
    assert policy.expires_at(100, 1_000) == 1_100


def test_clamps_as_artemis():
    both = ExpiryPolicy(ExpirationMode.ENABLED, None, 1_000, 60_000)
    assert both.lifetime_ms(10) == 1_000
    assert both.lifetime_ms(120_000) == 60_000
    assert both.lifetime_ms(5_000) == 5_000
    assert both.lifetime_ms(None) == 60_000  # no lifetime -> max
    assert both.lifetime_ms(0) == 60_000  # "never" is still bounded by the operator's max
    assert ExpiryPolicy(ExpirationMode.ENABLED, None, 1_000, None).lifetime_ms(None) == 1_000  # else min


def test_topic_default_overrides_the_clamps():
    # Artemis: any expiry-delay overrides min/max-expiry-delay, and a message's own expiration is
    # left unchanged; the topic default lifetime is ksow's expiry-delay.
    policy = ExpiryPolicy(ExpirationMode.DEFAULT, 1_000, 5_000, 10_000)
    assert not policy.clamped
    assert policy.lifetime_ms(None) == 1_000
    assert policy.lifetime_ms(60_000) == 60_000
    assert policy.lifetime_ms(10) == 10
    assert policy.lifetime_ms(0) is None


@pytest.mark.parametrize("kwargs", [dict(mode=ExpirationMode.DEFAULT), dict(default_ms=5), dict(mode=ExpirationMode.DEFAULT, default_ms=0), dict(min_ms=0), dict(max_ms=-1)])
def test_policy_rejects_settings_without_meaning(kwargs):
    with pytest.raises(ValueError):
        ExpiryPolicy(**kwargs)


lifetimes = st.none() | st.integers(0, 10**9)
bounds = st.none() | st.integers(1, 10**9)


@st.composite
def policies(draw):
    mode = draw(st.sampled_from(ExpirationMode))
    default = draw(st.integers(1, 10**9)) if mode is ExpirationMode.DEFAULT else None
    lo, hi = sorted([draw(bounds) or 0, draw(bounds) or 0])
    return ExpiryPolicy(mode, default, lo or None, hi or None)


@given(policies(), lifetimes)
def test_lifetime_property(policy, message_ms):
    """The whole rule: the message's lifetime (0 = never), else the topic default; clamped only on
    topics without a default, where a record with no lifetime takes max, else min."""
    wanted = (message_ms or None) if message_ms is not None else policy.default_ms
    got = policy.lifetime_ms(message_ms)
    if policy.default_ms is not None or (policy.min_ms is None and policy.max_ms is None):
        assert got == wanted
    elif wanted is None:
        assert got == (policy.max_ms if policy.max_ms is not None else policy.min_ms)
    else:
        assert got is not None
        assert got >= (policy.min_ms or 0) and (policy.max_ms is None or got <= policy.max_ms)
        if (policy.min_ms or 0) <= wanted <= (policy.max_ms or wanted):
            assert got == wanted


def test_is_due():
    assert is_due(100, 100) and is_due(99, 100)
    assert not is_due(101, 100) and not is_due(None, 100)


@given(policies(), st.none() | st.integers(0, 10**6), st.integers(0, 10**6))
def test_a_record_is_live_until_its_instant(policy, expires_at, now):
    # At its instant a record is gone; on a disabled topic instants are stored, never acted on.
    assert policy.is_live(expires_at, now) == (not policy.active or expires_at is None or expires_at > now)


@pytest.mark.parametrize("text", ["0.4ms", "0.0001", "0.0004s"])
def test_a_positive_lifetime_too_short_to_count_is_one_millisecond_not_never(text):
    """0 means never expires: a lifetime under half a millisecond must not round to it."""
    assert parse_duration_ms(text) == 1


@pytest.mark.parametrize("text", ["٦٠", "６０", "1\u00a0s", "٣s"])
def test_a_duration_is_written_in_ascii_digits(text):
    """Python's float() reads the digits of every script: a `sow-expiration` of Arabic-Indic or
    full-width digits was a lifetime, where `1D` or `2H` is an error."""
    with pytest.raises(DurationError):
        parse_duration_ms(text)
