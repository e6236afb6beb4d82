"""Scaling-law sweeps: the sweep file and its points (spec), the power-law fits, optima, gaps and
findings (laws), their figures (plots) and the sweep's MLflow runs (tracking). The runner that
trains the points through pipeline.stages is pipeline/sweep.py, at the top."""
