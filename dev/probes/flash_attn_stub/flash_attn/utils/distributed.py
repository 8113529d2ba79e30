from flash_attn import _missing as all_gather  # noqa: F401
