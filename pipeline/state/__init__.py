"""The run root and its layout: storage with atomic writes and `_SUCCESS` markers, the layout that
is the contract between stages, the run lock, module files and shards. Imports only pipeline.core.
"""
