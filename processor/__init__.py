"""ksow: State of the World for Kafka.

Layout:
  processor.api     public types: SowKey, commands, output events, the store contract
  processor.core    the pure semantic core (keys, merge, diff, filters, expiry maths, policies)
  processor.state   SOW stores: base contract, rocksdb and memory backends
  processor.runner  thin runners: the Faust worker (and the Spark pipeline)
  processor.broker  the embedded Apache Kafka broker
  processor.client  the Python client; processor.cli the `ksow` command
"""

__version__ = "0.1.0"
