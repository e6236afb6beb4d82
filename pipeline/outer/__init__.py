"""The DiLoCo outer step over the module grid: whole-round and per-module merges, and the
compressed outer gradients they read (outer.compression). Imports
pipeline.core and pipeline.state.
"""
