"""dipaco's pipeline: config, storage contract, path trainer, outer merge, evaluation, CLI."""
