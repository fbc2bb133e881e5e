"""The student: ``contract.py`` checks that ggk would run it as transformers does (config.json and tensor headers,
no torch); ``from_gguf.py`` turns a GGUF student into the transformers Qwen3 folder the rest reads."""
