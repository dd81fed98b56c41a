"""The public contract: the vocabulary every layer shares (commands, records, output events),
the header names of the topics, and the error types."""
