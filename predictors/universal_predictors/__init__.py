"""Predictor processes: one model per process behind KServe's ModelServer and an OpenAI-compatible layer.

Importing this package must stay cheap: the operator imports :mod:`universal_predictors.config`.
"""
