"""A real Apache Kafka broker (KRaft, single combined node) run as a child JVM.

Why: the project must be testable and runnable on a machine without Docker, against the
real broker rather than a fake one (fakes have wrong batch offsets, no compaction, ...).
The broker jars are resolved once from Maven Central into a per-user cache.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from processor.processes import die_with_parent_hook

KAFKA_VERSION = "4.1.1"
NODE_ID = 1

# Copy of ops/kafka-pom.xml so an installed package (no repo checkout) can resolve the jars.
# tests/integration/test_broker.py checks the two stay equal.
POM_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Resolves the Apache Kafka broker (KRaft) and its runtime dependencies for the embedded broker.
     Used by processor/kafka/embedded.py (which carries a copy as POM_XML; keep both equal):
     mvn -f ops/kafka-pom.xml dependency:copy-dependencies
         -DoutputDirectory=DIR -DincludeScope=runtime
     Kafka 4.x logs through log4j2; its slf4j 1.7 API is bound to log4j2 by log4j-slf4j-impl. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.ksow</groupId>
  <artifactId>ksow-embedded-kafka</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <properties>
    <kafka.version>4.1.1</kafka.version>
    <log4j.version>2.24.3</log4j.version>
  </properties>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>${kafka.version}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>${log4j.version}</version>
    </dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-dependency-plugin</artifactId>
        <version>3.8.1</version>
      </plugin>
    </plugins>
  </build>
</project>
"""

LOG4J2_PROPERTIES = """\
status = warn
shutdownHook = disable
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""

# Broker settings for a one-node dev/test cluster: everything replicated once, no
# auto-created topics (so typos fail loudly), fast group joins, few threads (2-core
# machines), and a log cleaner that runs often enough for compaction tests.
BASE_CONFIG: dict[str, str] = {
    "process.roles": "broker,controller",
    "node.id": str(NODE_ID),
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "share.coordinator.state.topic.num.partitions": "4",
    "group.initial.rebalance.delay.ms": "0",
    "auto.create.topics.enable": "false",
    "num.partitions": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "log.cleaner.enable": "true",
    "log.cleaner.threads": "1",
    "log.cleaner.backoff.ms": "500",
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
    "log.segment.bytes": str(8 * 1024 * 1024),
    "log.retention.check.interval.ms": "5000",
    "num.network.threads": "2",
    "num.io.threads": "4",
    "background.threads": "4",
    "num.recovery.threads.per.data.dir": "1",
}

# Secured mode: clients authenticate with SCRAM-SHA-512 over TLS on the client listener; the
# controller listener (loopback only) takes SASL/PLAIN, so that every principal the authorizer
# sees is a named user and no anonymous connection is a super user.
SCRAM_MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "admin"
BROKER_USER = "broker"
_SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"

_TEMP_PREFIX = "ksow-kafka-"
_OWNER_FILE = "owner.pid"


class BrokerError(RuntimeError):
    """The embedded broker could not be provisioned, started or kept running."""


# ---------------------------------------------------------------- jars and tools


def cache_root() -> Path:
    """Per-user cache: $KSOW_CACHE, else $XDG_CACHE_HOME/ksow, else ~/.cache/ksow."""
    if os.environ.get("KSOW_CACHE"):
        return Path(os.environ["KSOW_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ksow"


def _pom_text() -> str:
    """The repo's pom when running from a checkout (so edits take effect), else the copy."""
    repo_pom = Path(__file__).resolve().parents[2] / "ops" / "kafka-pom.xml"
    if repo_pom.is_file():
        return repo_pom.read_text()
    return POM_XML


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Cross-process lock so parallel test runs do not download into the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def java_executable() -> str:
    """The java binary ($JAVA_HOME first); Kafka 4.x brokers need Java 17+."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise BrokerError(
            "the embedded Kafka broker needs Java 17+ and Maven: no `java` on PATH "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless maven)"
        )
    return found


def kafka_jars() -> Path:
    """Folder holding the broker's runtime jars, resolved once with Maven into the cache.

    $KSOW_KAFKA_LIBS may point at an existing folder of jars (e.g. a Kafka
    distribution's libs/) to skip Maven entirely.  A marker file holding the pom's hash
    is written last, so an interrupted download, or a changed pom, is redone.
    """
    if os.environ.get("KSOW_KAFKA_LIBS"):
        libs = Path(os.environ["KSOW_KAFKA_LIBS"]).expanduser()
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"KSOW_KAFKA_LIBS={libs} holds no kafka_2.13-*.jar")
        return libs
    pom = _pom_text()
    digest = hashlib.sha256(pom.encode()).hexdigest()
    home = cache_root() / f"kafka-{KAFKA_VERSION}"
    libs, marker = home / "libs", home / ".complete"
    if marker.is_file() and marker.read_text().strip() == digest:
        return libs
    with _file_lock(cache_root() / f"kafka-{KAFKA_VERSION}.lock"):
        if marker.is_file() and marker.read_text().strip() == digest:
            return libs  # another process finished it while we waited
        mvn = shutil.which("mvn")
        if not mvn:
            raise BrokerError(
                "the embedded Kafka broker needs Java 17+ and Maven: no `mvn` on PATH to "
                "fetch the Kafka jars (Debian/Ubuntu: apt-get install maven)"
            )
        java_executable()
        marker.unlink(missing_ok=True)
        shutil.rmtree(libs, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="ksow-pom-") as tmp:
            pom_path = Path(tmp) / "pom.xml"
            pom_path.write_text(pom)
            cmd = [
                mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(pom_path),
                "dependency:copy-dependencies", f"-DoutputDirectory={libs}",
                "-DincludeScope=runtime",
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0 or not any(libs.glob("kafka_2.13-*.jar")):
            out = (done.stdout + done.stderr).strip()[-3000:]
            raise BrokerError(f"mvn could not resolve the Kafka jars:\n{out}")
        marker.write_text(digest + "\n")
    return libs


def _format_command(libs, props: Path, log4j: Path) -> list[str]:
    """Kafka's storage format tool for a KRaft data folder (a fresh cluster id each time)."""
    return [
        java_executable(), f"-Dlog4j2.configurationFile={log4j}",
        "-cp", _classpath(libs), "kafka.tools.StorageTool", "format",
        "-t", _kafka_uuid(), "-c", str(props),
    ]  # fmt: skip


def _classpath(libs: Path) -> str:
    return os.pathsep.join(str(p) for p in sorted(libs.glob("*.jar")))


def _bootstrap_checkpoint(libs: Path) -> Path:
    """A formatted KRaft bootstrap.checkpoint, made once per jar set and then copied.

    Why: it only records the metadata.version and feature levels (no cluster id), and
    formatting with StorageTool costs a second JVM launch (~1.5 s) on every start.
    """
    key = hashlib.sha256("\n".join(sorted(p.name for p in libs.glob("*.jar"))).encode())
    target = cache_root() / "bootstrap" / f"{key.hexdigest()[:16]}.checkpoint"
    if target.is_file():
        return target
    with _file_lock(cache_root() / "bootstrap.lock"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="ksow-format-") as tmp:
            data = Path(tmp) / "data"
            props = Path(tmp) / "server.properties"
            config = dict(BASE_CONFIG)
            config["log.dirs"] = str(data)
            config["controller.quorum.voters"] = f"{NODE_ID}@127.0.0.1:9093"
            config["listeners"] = "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
            _write_properties(props, config)
            log4j = Path(tmp) / "log4j2.properties"
            log4j.write_text(LOG4J2_PROPERTIES)
            done = subprocess.run(_format_command(libs, props, log4j), capture_output=True, text=True)
            made = data / "bootstrap.checkpoint"
            if done.returncode != 0 or not made.is_file():
                out = (done.stdout + done.stderr).strip()[-3000:]
                raise BrokerError(f"kafka StorageTool format failed:\n{out}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".tmp{os.getpid()}")
            shutil.copyfile(made, partial)
            partial.replace(target)
    return target


# ---------------------------------------------------------------- small helpers


def _kafka_uuid() -> str:
    """A Kafka Uuid string (url-safe base64, no padding, not starting with '-')."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _write_properties(path: Path, config: Mapping[str, str]) -> None:
    path.write_text("".join(f"{k}={v}\n" for k, v in config.items()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_temp_dirs() -> None:
    """Remove temp data dirs left by killed processes (their brokers died with them)."""
    for d in Path(tempfile.gettempdir()).glob(_TEMP_PREFIX + "*"):
        try:
            pid = int((d / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no broker log)"


_LIVE: weakref.WeakSet[EmbeddedKafka] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for broker in list(_LIVE):
        broker.stop()


# ---------------------------------------------------------------- the broker


class EmbeddedKafka:
    """One KRaft node (broker + controller) listening on 127.0.0.1 only.

    Usage: ``with EmbeddedKafka() as kafka: ... kafka.bootstrap ...``.  Without
    ``data_dir`` the data lives in a temp dir removed on stop; with one, the data
    persists and a later broker on the same dir restarts from it (recovery tests).
    ``config`` overrides or adds broker properties.

    ``secured=True``: the client listener takes SASL_SSL only (SCRAM-SHA-512, a CA and server
    certificate made at first start), an authorizer lets nothing through without an ACL, and
    the users ``admin`` and ``broker`` are super users. ``client_config`` (and the file at
    ``client_config_path``, for ``--kafka-config``) is what a client needs to connect as admin.
    Passwords and certificates live in the data dir, so a restart on it keeps them.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | str | None = None,
        partitions: int = 1,
        config: Mapping[str, str] | None = None,
        heap: str = "512m",
        startup_timeout: float = 90.0,
        secured: bool = False,
    ) -> None:
        self.requested_port = port
        self.port: int | None = port
        self.controller_port: int | None = None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.partitions = partitions
        self.overrides = dict(config or {})
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.secured = secured
        self._passwords: dict[str, str] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._own_dir = False
        self._lock = threading.Lock()

    # -- properties

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("broker not started")
        return f"127.0.0.1:{self.port}"

    @property
    def client_config(self) -> dict[str, str]:
        """librdkafka properties a client needs besides bootstrap.servers ({} when unsecured)."""
        if not self.secured:
            return {}
        if not self._passwords:
            raise BrokerError("broker not started")
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": ADMIN_USER,
            "sasl.password": self._passwords[ADMIN_USER],
            "ssl.ca.location": str(self._security_dir / "ca.pem"),
        }

    @property
    def client_config_path(self) -> Path:
        """A properties file with bootstrap.servers and `client_config`, written at start."""
        if not self.secured:
            raise BrokerError("client_config_path exists for a secured broker only")
        return self._security_dir / "client.properties"

    @property
    def _security_dir(self) -> Path:
        if self.data_dir is None:
            raise BrokerError("broker not started")
        return self.data_dir / "security"

    @property
    def log_path(self) -> Path:
        if self.data_dir is None:
            raise BrokerError("broker not started")
        return self.data_dir / "broker.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- lifecycle

    def start(self) -> EmbeddedKafka:
        """Format storage if new, launch the JVM, and wait until it serves metadata."""
        if self.running:
            return self
        began = time.monotonic()
        libs = kafka_jars()
        if self.data_dir is None:
            _sweep_stale_temp_dirs()
            self.data_dir = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
            (self.data_dir / _OWNER_FILE).write_text(str(os.getpid()))
            self._own_dir = True
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            if self.secured:
                self._prepare_security()
            self._format(libs)
            self._launch_until_ready(libs, began)
            if self.secured:
                _write_properties(self.client_config_path, {"bootstrap.servers": self.bootstrap, **self.client_config})
        except BaseException:
            self._terminate()
            self._cleanup_dir()
            raise
        self.startup_seconds = time.monotonic() - began
        _LIVE.add(self)
        return self

    def _launch_until_ready(self, libs: Path, began: float) -> None:
        """Launch; with auto-picked ports, retry if another process grabbed one first."""
        attempts = 1 if self.requested_port is not None else 3
        if self.requested_port is not None and _port_open(self.requested_port):
            # Checked first: another broker there would answer the readiness checks as if it were this one.
            raise BrokerError(f"port {self.requested_port} is in use (another broker?): choose another port, or none to get a free one")
        for attempt in range(attempts):
            self.port = self.requested_port or _free_port()
            self.controller_port = _free_port()
            while self.controller_port == self.port:
                self.controller_port = _free_port()
            self._launch(libs)
            try:
                self._await_ready(began)
                return
            except BrokerError:
                self._terminate()
                bind_clash = "Address already in use" in _tail(self.log_path, 200)
                if not bind_clash or attempt == attempts - 1:
                    raise

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (clean shutdown, flushes logs), then SIGKILL after `timeout`."""
        with self._lock:
            self._terminate(timeout)
            _LIVE.discard(self)
            self._cleanup_dir()

    def __enter__(self) -> EmbeddedKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals

    def _format(self, libs: Path) -> None:
        """Lay out a fresh KRaft log dir: our meta.properties + the cached checkpoint."""
        assert self.data_dir is not None
        kraft = self.data_dir / "kraft"
        if (kraft / "meta.properties").is_file():
            return  # existing data: restart from it
        if self.secured:
            self._format_with_users(libs)
            return
        kraft.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_bootstrap_checkpoint(libs), kraft / "bootstrap.checkpoint")
        meta = {
            "version": "1",
            "node.id": str(NODE_ID),
            "cluster.id": _kafka_uuid(),
            "directory.id": _kafka_uuid(),
        }
        _write_properties(kraft / "meta.properties", meta)

    def _format_with_users(self, libs: Path) -> None:
        """Format with the SCRAM users in the bootstrap metadata (the cached checkpoint has none,
        and SCRAM credentials cannot be created over a listener that already requires them)."""
        assert self.data_dir is not None
        with tempfile.TemporaryDirectory(prefix="ksow-format-") as tmp:
            props, log4j = Path(tmp) / "server.properties", Path(tmp) / "log4j2.properties"
            _write_properties(props, self._server_config(9092, 9093))  # the ports do not matter here
            log4j.write_text(LOG4J2_PROPERTIES)
            cmd = _format_command(libs, props, log4j)
            for user, password in self._passwords.items():
                cmd += ["--add-scram", f"{SCRAM_MECHANISM}=[name={user},password={password}]"]
            done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not (self.data_dir / "kraft" / "meta.properties").is_file():
            out = (done.stdout + done.stderr).strip()[-3000:]
            raise BrokerError(f"kafka StorageTool format failed:\n{out}")

    def _prepare_security(self) -> None:
        """Passwords and TLS files: made at the first start, reused on a restart."""
        from processor.kafka.certs import make_server_tls

        folder = self._security_dir
        folder.mkdir(mode=0o700, exist_ok=True)
        saved = folder / "passwords.json"
        if saved.is_file():
            self._passwords = json.loads(saved.read_text())
            return
        make_server_tls(folder)
        self._passwords = {ADMIN_USER: secrets.token_urlsafe(24), BROKER_USER: secrets.token_urlsafe(24)}
        saved.touch(mode=0o600)
        saved.write_text(json.dumps(self._passwords))

    def _server_config(self, port: int, controller_port: int) -> dict[str, str]:
        assert self.data_dir is not None
        config = dict(BASE_CONFIG)
        config.update(
            {
                "log.dirs": str(self.data_dir / "kraft"),
                "num.partitions": str(self.partitions),
                "controller.quorum.voters": f"{NODE_ID}@127.0.0.1:{controller_port}",
                "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            }
        )
        if self.secured:
            config.update(self._secured_config(port, controller_port))
        config.update(self.overrides)
        return config

    def _secured_config(self, port: int, controller_port: int) -> dict[str, str]:
        """SASL_SSL (SCRAM) for clients and the broker itself, SASL/PLAIN for the controller."""
        folder = self._security_dir
        broker_password = self._passwords[BROKER_USER]
        return {
            "listeners": f"CLIENT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"CLIENT://127.0.0.1:{port}",
            "listener.security.protocol.map": "CLIENT:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
            "inter.broker.listener.name": "CLIENT",
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.client.sasl.enabled.mechanisms": SCRAM_MECHANISM,
            f"listener.name.client.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": (
                f'{_SCRAM_LOGIN} required username="{BROKER_USER}" password="{broker_password}";'
            ),
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                f'{_PLAIN_LOGIN} required username="{BROKER_USER}" password="{broker_password}" '
                f'user_{BROKER_USER}="{broker_password}";'
            ),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(folder / "server-keystore.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(folder / "ca.pem"),
            "ssl.client.auth": "none",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{BROKER_USER};User:{ADMIN_USER}",
        }

    def _launch(self, libs: Path) -> None:
        assert self.data_dir is not None and self.port is not None and self.controller_port is not None
        props = self.data_dir / "server.properties"
        _write_properties(props, self._server_config(self.port, self.controller_port))
        log4j = self.data_dir / "log4j2.properties"
        log4j.write_text(LOG4J2_PROPERTIES)
        cmd = [
            java_executable(), f"-Xmx{self.heap}", "-Xss1m", "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={log4j}",
            "-cp", _classpath(libs), "kafka.Kafka", str(props),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,  # Ctrl-C reaches us; we stop the JVM in order
                preexec_fn=die_with_parent_hook(),
            )

    def _await_ready(self, began: float) -> None:
        """Wait for the port, then for a metadata answer naming this broker."""
        from confluent_kafka.admin import AdminClient

        assert self.process is not None and self.port is not None
        deadline = began + self.startup_timeout
        admin = None
        while True:
            if self.process.poll() is not None:
                raise BrokerError(
                    f"embedded Kafka exited with code {self.process.returncode} during "
                    f"startup; log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"embedded Kafka did not answer within {self.startup_timeout:.0f}s; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if _port_open(self.port):
                if admin is None:
                    admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0, **self.client_config})
                try:
                    if NODE_ID in admin.list_topics(timeout=2).brokers:
                        return
                except Exception:  # noqa: BLE001 - KafkaException while still booting
                    pass
            time.sleep(0.1)

    def _terminate(self, timeout: float = 30.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _cleanup_dir(self) -> None:
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None
            self._own_dir = False


# ---------------------------------------------------------------- `ksow broker`


def run_foreground(port: int | None = None, data_dir: Path | str | None = None, secured: bool = False) -> None:
    """Run a broker until Ctrl-C or SIGTERM (the `ksow broker` command).

    The bootstrap address is the first line of stdout so scripts can read it; every
    other message goes to stderr. Secured, the second line of stdout is the path of the
    client properties file (for `--kafka-config` / KSOW_KAFKA_CONFIG).
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmbeddedKafka(port=port, data_dir=data_dir, secured=secured) as kafka:
            print(kafka.bootstrap, flush=True)
            if secured:
                print(kafka.client_config_path, flush=True)
            print(
                f"Kafka {KAFKA_VERSION} (KRaft) ready at {kafka.bootstrap} in "
                f"{kafka.startup_seconds:.1f}s; log: {kafka.log_path}; Ctrl-C stops it",
                file=sys.stderr,
                flush=True,
            )
            if secured:
                print(
                    f"secured: SASL_SSL with {SCRAM_MECHANISM}, user {ADMIN_USER} (a super user); "
                    f"clients: --kafka-config {kafka.client_config_path}",
                    file=sys.stderr,
                    flush=True,
                )
            while not stop.wait(0.5):
                if not kafka.running:
                    code = kafka.process.returncode if kafka.process else None
                    raise BrokerError(
                        f"embedded Kafka exited unexpectedly (code {code}); "
                        f"log {kafka.log_path}:\n{_tail(kafka.log_path)}"
                    )
            print("stopping Kafka ...", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
