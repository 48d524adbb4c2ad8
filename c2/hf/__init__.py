"""Hugging Face DeepseekV3/Kimi checkpoints: config mapping, safetensors store, import/export,
and the `python -m c2.hf.convert` CLI."""
