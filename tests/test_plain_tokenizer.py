"""kvsnap.models.plain_tokenizer: tokenizer.json on the tokenizers library, for a process without transformers.

It must give what transformers' own tokenizer of the folder gives (ids, offsets, decoded text,
special tokens; chat templates: tests/test_chat_jinja.py), take only folders where that holds by
construction, and keep transformers out of a native process that runs a raw prompt (tests/test_native.py).
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
from tiny_models import SPECIAL_TOKENS

from kvsnap.models.plain_tokenizer import PlainTokenizer, plain_tokenizer


def _texts(specials: list[str], n: int = 150) -> list[str]:
    rng = random.Random(0)
    alphabet = "abc XYZ<>|_\n\té中🎉0123456789.,!?"
    texts = ["", " ", "Hello world", "  leading\n\ttabs", "émoji 🎉 中文 текст", "\n\n\n", "The quick brown fox. " * 20]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]
    texts += ["".join(rng.choice([*specials, "word ", " ", "\n", "é"]) for _ in range(16)) for _ in range(n)]
    return texts


def assert_same_tokenizer(plain: PlainTokenizer, full) -> None:
    specials = list(full.all_special_tokens)
    for text in _texts(specials):
        for add in (True, False):
            ids = full(text, add_special_tokens=add)["input_ids"]
            assert plain(text, add_special_tokens=add)["input_ids"] == list(ids), text
            a = plain(text, add_special_tokens=add, return_offsets_mapping=True)["offset_mapping"]
            b = full(text, add_special_tokens=add, return_offsets_mapping=True)["offset_mapping"]
            assert [tuple(x) for x in a] == [tuple(x) for x in b], text
            split = plain(text, add_special_tokens=add, split_special_tokens=True)["input_ids"]
            assert split == list(full(text, add_special_tokens=add, split_special_tokens=True)["input_ids"]), text
        assert plain.encode(text) == full.encode(text)
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(full)) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert plain.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids
    for token in [*specials, "hello", "not-a-token-at-all"]:
        assert plain.convert_tokens_to_ids(token) == full.convert_tokens_to_ids(token)
    assert len(plain) == len(full)
    assert plain.all_special_tokens == list(full.all_special_tokens)
    assert plain.special_tokens_map == full.special_tokens_map
    assert plain.chat_template == full.chat_template
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(plain, name) == getattr(full, name), name
    assert {i: (t.content, t.special) for i, t in plain.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in full.added_tokens_decoder.items()
    }


def test_the_plain_tokenizer_is_transformers_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tiny_model_dir("llama")
    plain = plain_tokenizer(folder)
    assert isinstance(plain, PlainTokenizer)
    assert_same_tokenizer(plain, AutoTokenizer.from_pretrained(str(folder)))


@pytest.mark.parametrize(
    "change",
    [
        {"clean_up_tokenization_spaces": True},
        {"add_bos_token": True},
        {"sep_token": "<|im_start|>"},
        {"tokenizer_class": "LlamaTokenizerFast"},
        {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
        {"extra_special_tokens": ["<|im_start|>"]},
        {"bos_token": "<|not-an-added-token|>"},
    ],
)
def test_folders_transformers_would_change_are_left_to_it(tiny_model_dir, tmp_path, change):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert plain_tokenizer(folder) is None


def test_a_tokenizer_with_truncation_or_extra_files_is_left_to_transformers(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    folder = shutil.copytree(src, tmp_path / "trunc")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    assert plain_tokenizer(folder) is None
    folder = shutil.copytree(src, tmp_path / "extra")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": SPECIAL_TOKENS[0]}))
    assert plain_tokenizer(folder) is None
    folder = shutil.copytree(src, tmp_path / "templates")  # transformers reads these too; a default.jinja wins
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "default.jinja").write_text("{{ messages[0]['content'] }}")
    assert plain_tokenizer(folder) is None
    assert plain_tokenizer(shutil.copytree(src, tmp_path / "plain")) is not None


@pytest.mark.slow
def test_the_default_models_plain_tokenizer_is_transformers_tokenizer(real_model_folder):
    from transformers import AutoTokenizer

    folder = real_model_folder
    plain = plain_tokenizer(folder)
    assert isinstance(plain, PlainTokenizer)
    assert_same_tokenizer(plain, AutoTokenizer.from_pretrained(str(folder)))


def test_preload_loads_transformers_tokenizer_in_the_background_where_it_renders_the_template(tiny_model_dir):
    """A template kvsnap.models.chat_jinja leaves to transformers (tests/test_chat_jinja.py: the others)."""
    import threading

    plain = plain_tokenizer(tiny_model_dir("llama"))
    plain.chat_template = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    assert plain._full is None
    plain.preload()  # what `kvsnap chat` and `kvsnap serve` do once the model is loaded
    for thread in threading.enumerate():
        if thread.name == "kvsnap-tokenizer":
            thread.join(timeout=120)
    assert plain._full is not None and plain.full is plain._full  # loaded once, by the thread


def test_keeping_special_text_as_text_never_leaks_into_a_concurrent_encode(tiny_model_dir):
    """split_special_tokens runs on its own copy of the tokenizer: a plain encode in another thread at
    the same moment still turns <|im_end|> into its control id."""
    import threading

    plain = plain_tokenizer(tiny_model_dir("llama"))
    text = "a <|im_end|> b " * 50
    control = plain(text, add_special_tokens=False)["input_ids"]
    split = plain(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert control != split
    wrong = []

    def encode_plain():
        for _ in range(200):
            if plain(text, add_special_tokens=False)["input_ids"] != control:
                wrong.append(1)

    thread = threading.Thread(target=encode_plain)
    thread.start()
    for _ in range(200):
        assert plain(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == split
    thread.join()
    assert not wrong
    import torch

    assert plain.decode(torch.tensor(control)) == plain.decode(control)
