"""MLflow: the tracker, the model registry and its pyfunc, plots, utilisation and the run summary.
One way only: tracker -> registry -> uris. Imports everything below it; nothing below imports it.
"""
