"""The DiLoCo outer step over the module grid: whole-round and per-module merges. Imports
pipeline.core and pipeline.state.
"""
