"""Model folders: what cannot load stops with one message naming the folder."""
from __future__ import annotations


def test_model_folders_that_cannot_work_get_one_message(tmp_path):
    """Bad model folders (issue 6): a folder without config.json, a file, a tokenizer without pad
    and eos tokens. A tokenizer with eos but no pad borrows eos (padding is masked out)."""
    import os
    import shutil

    import pytest

    from common.errors import UserError
    from common.training.models import load_causal_lm, load_tokenizer
    from common.training.tiny import tiny_model_path

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"empty: no config.json in this folder"):
        load_causal_lm(str(empty))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match=r"weights.bin: a file, not a model folder"):
        load_tokenizer(str(tmp_path / "weights.bin"))

    from transformers import AutoTokenizer

    for name, drop in (("no_pad", ("pad_token",)), ("no_pad_no_eos", ("pad_token", "eos_token"))):
        t = AutoTokenizer.from_pretrained(tiny_model_path())
        for attr in drop:
            setattr(t, attr, None)
        t.save_pretrained(str(tmp_path / name))
        shutil.copy(os.path.join(tiny_model_path(), "config.json"), tmp_path / name)  # a model folder
    tok = load_tokenizer(str(tmp_path / "no_pad"))
    assert tok.pad_token_id == tok.eos_token_id is not None
    with pytest.raises(UserError, match=r"neither a pad nor an eos token; add a pad token"):
        load_tokenizer(str(tmp_path / "no_pad_no_eos"))
