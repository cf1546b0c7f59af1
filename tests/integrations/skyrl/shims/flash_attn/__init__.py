"""Test-venv stand-in for the `flash_attn` package: only `flash_attn.bert_padding` (`bert_padding.py`).

SkyRL 0.4.0's `workers/model_wrapper.py` imports `flash_attn.bert_padding.{pad_input, unpad_input}` at module
level; flash-attn does not build without CUDA, so the CPU tests put this folder on sys.path
(tests/integrations/skyrl/conftest.py). A real flash-attn install is never shadowed: the conftest adds this
folder only when `flash_attn` does not import.
"""
