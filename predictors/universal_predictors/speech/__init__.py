"""Speech: audio uploads decoded within limits, and the engines that transcribe them (the transcribe task)."""
