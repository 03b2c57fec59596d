"""Anomaly detection for ``task: anomaly``: PyOD detectors behind a robust scaler, persisted safely.

Modules: :mod:`.algorithms` (the allowlisted PyOD algorithms and their parameters), :mod:`.features`
(numeric rows and schema rows to a matrix), :mod:`.normalize` (raw scores to normalised scores),
:mod:`.detector` (a fitted detector), :mod:`.store` (the state directory, never unpickled).
"""
