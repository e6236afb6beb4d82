"""Routed perplexity and bits per byte of a round's modules, per path and combined, and the
discriminative re-routing that those per-path losses drive (reroute; its Beam job is passed in).
Imports pipeline.core, pipeline.state and pipeline.routing.
"""
