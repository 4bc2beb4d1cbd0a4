"""The torch-free text side: tokenizers, chat templates and the output processor that turns
engine deltas into text (the offline LLM and the server share it)."""
