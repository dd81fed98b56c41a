"""The Python client: publish, delete, query and subscribe, as the `ksow` command line does."""

from processor.client.sow_client import Client, ClientError, SowEntry, delete, publish, query, subscribe

__all__ = ["Client", "ClientError", "SowEntry", "delete", "publish", "query", "subscribe"]
