"""The SOW engine: the rules of one SOW partition written once over a small state protocol, used by
every runner (the Faust worker, Spark streaming) and by the reference fold."""
