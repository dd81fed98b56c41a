"""The Faust application: worker lifecycle, the transactional input loop, HTTP queries, metrics."""
