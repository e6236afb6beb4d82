"""Configuration (and configdoc, which writes docs/config.md from it), errors and bounds: what every
other part of the pipeline may import, and which imports none of them.
"""
