"""dipaco's pipeline, grouped by job, each package importing only those before it:

    core        config, errors, bounds, stalls (the time a reader's own requests to the run root hung)
    state       the run root: storage, layout (the contract between stages), lock, modules, shards
    routing     tokenizer, prefix embedders, (product) k-means, the Router artifact, the
                discriminative classifier: one routing for prepare, training, evaluation, inference
    outer       the DiLoCo outer merge (whole round, or module by module), outer-gradient compression
    train       one path for one round on DeepSpeed ZeRO (writes its outer gradient compressed)
    evaluation  routed perplexity and bits per byte; the discriminative re-routing after round R
    islands     long-lived trainers pulling tasks from the run root's queue, their supervisor; one-shot launches
    tracking    MLflow tracker, registry and pyfunc, plots, utilisation, the run summary
    scaling     scaling-law sweeps: the sweep file and its points, the power-law fits and findings,
                their plots, report and MLflow runs (the runner, pipeline/sweep.py, is at the top)

above them the Beam app (the top-level `preprocessing` package: read C4, embed, route, write
shards), which none of these packages imports, and at the top the stages the CLI and the Airflow
DAG call (stages, each taking the Run of run.py: config, run root, tracker; preflight, cli, sweep,
compile_warmup: a host's first torch.compile beside prepare or the wait for the plan)
and the entry point of an island's ranks (island_rank), which hand the Beam job to the layers below
where they need it. Below them all, `models`. tests/test_code_layout.py holds the rule, for
benchmarks/ and airflow/dags/ too.
"""
