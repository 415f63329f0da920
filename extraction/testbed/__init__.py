"""A target to run the whole pipeline against where no real model can be had (lab hosts, CI).

tiny: a deterministic tiny DeepSeek-V3-architecture model, its tokenizer with a chat template,
and a conversation set for it (`hsx tiny-model`, `hsx tiny-dataset`).
"""
