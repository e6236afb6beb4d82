"""The modular transformer: a grid of modules assembled into Llama paths. Knows nothing of
DeepSpeed, Beam or MLflow."""
