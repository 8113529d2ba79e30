from flash_attn import _missing as index_first_axis, _missing as pad_input, _missing as rearrange, _missing as unpad_input  # noqa: F401
