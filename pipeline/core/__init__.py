"""Configuration, errors and bounds: what every other part of the pipeline may import, and which
imports none of them.
"""
