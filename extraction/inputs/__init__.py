"""What an `hsx extract` run reads, and the checks made on it before anything heavy loads.

config: the options (CLI and YAML, one table); preflight: the torch-free input checks; dataset:
rows in, conversations out; chat_tokenizer: a conversation through the chat template; layers:
the EAGLE-3 capture layer ids.
"""
