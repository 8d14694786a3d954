"""KV storage (the cache, in-place buffers, int8/int4) and KV policies (StreamingLLM, SnapKV, H2O)."""
