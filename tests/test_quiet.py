"""Quiet by default: what a run prints is the run's own, not a library's noise."""

import logging
import subprocess
import sys

from conftest import REPO


def _stderr_of(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def test_importing_the_beam_job_prints_no_gcp_warnings_and_the_pyfunc_no_type_hint_warning():
    quiet = _stderr_of(
        "import logging; logging.basicConfig(); import preprocessing.transforms, pipeline.tracking.registry"
    )
    assert "apitools" not in quiet and "bigquery" not in quiet
    assert "Add type hints" not in quiet
    assert "apitools" in _stderr_of("import logging; logging.basicConfig(); import apache_beam")  # what it hides


def test_a_sensor_waiting_in_dags_test_is_not_reported_as_unrunnable(caplog):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dipaco_dag_quiet", REPO / "airflow" / "dags" / "dipaco_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class TI:
        def __init__(self, state):
            self.state = state

    quiet = module._SensorWaitIsNotAFailure()

    def record(*states):
        return logging.LogRecord(
            "airflow.sdk.definitions.dag",
            logging.WARNING,
            __file__,
            1,
            "No tasks to run. unrunnable tasks: %s",
            ({TI(s) for s in states},),
            None,
        )

    assert not quiet.filter(record("up_for_reschedule", None))  # a round's sensor waits: its normal state
    assert quiet.filter(record(None, None))  # nothing waits on a sensor: a real deadlock, still reported


def test_loading_the_minilm_embedder_draws_no_progress_bar_and_leaves_the_switches_as_they_were(capfd):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from pipeline.routing.embedders import MiniLMEmbedder

    before = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    capfd.readouterr()
    embedder = MiniLMEmbedder()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err[-500:]  # transformers 5's tqdm bar
    assert embedder.embed(["The French Revolution was"]).shape == (1, 384)
    assert (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before
