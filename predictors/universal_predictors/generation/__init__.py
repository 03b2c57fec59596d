"""Text generation: one OpenAI layer over interchangeable engines (transformers, llama.cpp, vLLM)."""
