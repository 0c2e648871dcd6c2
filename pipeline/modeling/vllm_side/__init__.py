"""Code that runs inside vLLM's own environment (pipeline/modeling/vllm_server.py puts this folder on its path)."""
