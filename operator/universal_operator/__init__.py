"""The UniversalModel operator: renders each model into a KServe InferenceService and mirrors its status."""
