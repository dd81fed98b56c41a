"""ksow: State of the World for Kafka.

Layout, from the outside in (docs/architecture.md follows one input through it):
  processor.contract     the public vocabulary: commands, records, output events, header names, errors
  processor.core         the pure semantic core: keys, merge, diff, filters, durations, expiry maths
  processor.engine       the SOW rules of one partition, written once over a small state protocol
  processor.state        SOW stores: the contract, RocksDB and memory backends
  processor.query        queries over stores: hash indexes, filtered scans
  processor.kafka        Kafka plumbing: client configuration, topics, the registry, the embedded broker
  processor.runners      thin runners: the Faust worker (transactional loop) and Spark streaming
  processor.batch        Spark batch jobs: snapshot, replay, SQL
  processor.client       the Python client; processor.cli the `ksow` command line
  processor.testing      worker subprocesses and broker discovery for tests and benchmarks
"""

__version__ = "0.1.0"
