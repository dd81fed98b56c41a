"""SOW stores: one contract (`base`), backends beside it (`rocksdb`, `memory`)."""

from processor.state.base import IndexSpec, PartitionStore, open_partition_store

__all__ = ["IndexSpec", "PartitionStore", "open_partition_store"]
