"""Routed perplexity and bits per byte of a round's modules, per path and combined. Imports
pipeline.core and pipeline.state.
"""
