"""The Beam app: the prepare job (read C4, embed prefixes, route with (product) k-means, write
shards), its re-sharding for the discriminative router, and the sample builder. The routing it
applies is pipeline.routing, shared with evaluation and inference; within pipeline/ only the top
(stages, cli, preflight, island_rank) imports this package (tests/test_code_layout.py)."""

import logging

# Importing apache_beam imports its GCP IO, which warns on every run that the BigQuery client
# libraries are missing (two lines, one on the root logger). The pipeline never touches GCP: the
# two messages are dropped where they are logged, before any module here imports Beam.
_GCP_NOISE = ("apitools not found, and bigquery client libraries", "No module named google.cloud.bigquery_storage")


class _DropGcpNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_GCP_NOISE)


for _name in ("", "apache_beam.io.gcp.bigquery"):
    logging.getLogger(_name).addFilter(_DropGcpNoise())
