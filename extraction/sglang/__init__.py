"""SGLang integration: the dump hook deployed into SGLang, its patch, its dump files, supported versions."""
