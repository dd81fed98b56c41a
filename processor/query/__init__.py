"""SOW queries over partition stores: hash-index lookups or filtered scans."""
