"""The names of the predictor's series that another program reads, defined once for both sides.

The gateway's Standard-mode TTL asks every replica's ``/metrics`` for these two (each gateway replica sees
only its own traffic). A plain module: the gateway imports it without prometheus_client's default registry
getting the predictor's series.
"""

from __future__ import annotations

#: Requests being processed now (a gauge).
IN_FLIGHT = "universal_predictor_in_flight"
#: Unix time of the latest request start or end (a gauge).
LAST_REQUEST = "universal_predictor_last_request_timestamp_seconds"
