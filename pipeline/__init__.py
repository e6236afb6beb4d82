"""dipaco's pipeline, grouped by job, each package importing only those before it:

    core        config, errors, bounds
    state       the run root: storage, layout (the contract between stages), lock, modules, shards
    outer       the DiLoCo outer merge (whole round, or module by module), outer-gradient compression
    train       one path for one round on DeepSpeed ZeRO (writes its outer gradient compressed)
    evaluation  routed perplexity and bits per byte
    islands     long-lived trainers pulling tasks from the run root's queue, their supervisor; one-shot launches
    tracking    MLflow tracker, registry and pyfunc, plots, utilisation, the run summary

and at the top the stages the CLI and the Airflow DAG call (stages, each taking the Run of run.py:
config, run root, tracker), preflight and cli.
tests/test_code_layout.py holds the rule.
"""
