"""Routing: what sends a document to a path, the same at prepare, training, evaluation and
inference time. The tokenizer, the prefix embedders, (product) k-means with balancing, the Router
artifact (router/, k-means or discriminative) and the discriminative classifier's fit. Imports
pipeline.core, pipeline.state and models, so the Beam job, evaluation and the registered model all
load one router the same way without importing each other.
"""
