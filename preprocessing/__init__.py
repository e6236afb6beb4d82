"""Beam prepare job: read C4, embed prefixes, route with (product) k-means, write shards."""

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
