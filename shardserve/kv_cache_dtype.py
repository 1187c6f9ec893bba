"""`--kv-cache-dtype`'s values (vLLM's names), importable without torch (the command line reads them):
"auto" stores keys and values in the model's compute dtype, "bfloat16" in bfloat16, "fp8" and "fp8_e4m3" in
FP8 e4m3 with a scale per layer (shardserve/attention/kv_quant.py)."""

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
FP8_NAMES = ("fp8", "fp8_e4m3")
