"""Beam prepare job: read C4, embed prefixes, route with (product) k-means, write shards."""
