"""KServe stand-ins: the status-only controller (:mod:`.standin`) and the process runner (:mod:`.processes`)."""
