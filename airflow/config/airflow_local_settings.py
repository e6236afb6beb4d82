"""Airflow local settings of the deployment `make services` starts (scripts/services.py puts this
folder on the PYTHONPATH of every Airflow process; Airflow imports the module at start-up).

The Celery worker imports the pipeline once, before it forks its pool: Airflow 3 forks every task
process from a pool process, so a task then finds torch, transformers, DeepSpeed and MLflow
imported instead of importing them itself (`import pipeline.stages` took 24 s on the loaded 2-core
test machine, paid by each of a DAG run's 13 tasks). The other components import nothing more.
Restart the worker after changing the pipeline's code.
"""

import sys

if sys.argv[1:3] == ["celery", "worker"]:
    import pipeline.stages  # noqa: F401
