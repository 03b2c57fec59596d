"""OCR engines and the input handling they share: decoding with limits, PDF rendering, reading order."""
