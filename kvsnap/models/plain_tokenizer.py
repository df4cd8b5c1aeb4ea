"""A model's ``tokenizer.json`` run by the ``tokenizers`` library, for a process that need not import transformers.

Why: the tokenizer is what still imports transformers in a process running the native forward
(``kvsnap.models.native``), and that import is a large part of a new process's start (most of
it transformers building its lazy module table), for a raw prompt that only needs ``encode`` and
``decode``. Those run the same Rust tokenizer transformers' ``TokenizersBackend`` runs, so they
give the same ids and text, provided transformers would leave that tokenizer as the file writes
it: ``plain_tokenizer`` takes only such a folder (no truncation or padding, every named special
token already a special added token, no extra special tokens or files, a vocabulary under the
size transformers patches). A plain chat's template renders through ``kvsnap.models.chat_jinja``,
transformers' sandbox rebuilt on jinja2. Everything else goes to the real transformers tokenizer,
loaded on first use (``full``).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from kvsnap.errors import ModelError
from kvsnap.paths import read_bounded

# transformers' SPECIAL_TOKENS_ATTRIBUTES order (all_special_tokens lists them in it); a config
# naming sep/cls/mask tokens is left to transformers.
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
# tokenizer_config.json keys that do not change what TokenizersBackend does to the file's tokenizer.
_INERT = {"backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only", "chat_template"}
# additional_chat_templates/: transformers reads its templates too (a default.jinja there replaces the main one).
_FILES_LEFT_TO_TRANSFORMERS = (
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_templates",
    "additional_chat_templates",
)
RELEASE_GIL_CHARS = 1 << 16
_MAX_VOCAB = 100_000  # transformers rewrites the pre-tokenizer of larger vocabularies (its Mistral regex fix)


def plain_tokenizer(folder: Path) -> PlainTokenizer | None:
    """The folder's tokenizer without transformers, or None when transformers must load it."""
    from kvsnap.paths import json_object

    config = json_object(folder / "tokenizer_config.json")
    if config is None or config.get("tokenizer_class") != "TokenizersBackend":
        return None
    if not set(config) <= _INERT | set(_NAMED) | {"clean_up_tokenization_spaces", "add_prefix_space"}:
        return None
    if config.get("clean_up_tokenization_spaces", False) is not False or config.get("add_prefix_space", False):
        return None
    named = {k: config[k] for k in _NAMED if config.get(k) is not None}
    if not all(isinstance(v, str) and v for v in named.values()):
        return None
    if any((folder / name).exists() for name in _FILES_LEFT_TO_TRANSFORMERS):
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(read_bounded(folder / "tokenizer.json", 256 << 20, error=ModelError).decode())
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    except Exception:  # the tokenizers library raises its own types for a damaged file
        return None
    if tok.truncation is not None or tok.padding is not None or tok.get_vocab_size() > _MAX_VOCAB:
        return None
    if not set(named.values()) <= specials:
        return None  # transformers would add it to the tokenizer first
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        try:
            template = read_bounded(jinja, 16 << 20, error=ModelError).decode()
        except (ModelError, UnicodeDecodeError):
            return None
    if template is not None and not isinstance(template, str):
        return None
    return PlainTokenizer(folder, tok, named, template)


class PlainTokenizer:
    """The calls kvsnap makes of a transformers tokenizer, on the ``tokenizers`` library; any other
    attribute (``apply_chat_template``, ...) is the real transformers tokenizer's (``full``)."""

    def __init__(self, folder: Path, tok, named: dict[str, str], chat_template: str | None):
        self.name_or_path = str(folder)
        self._tok = tok
        self._named = named
        self.chat_template = chat_template
        self._full = None
        self._split = None
        self._lock = threading.Lock()  # loading ``full``
        self._split_lock = threading.Lock()

    @property
    def full(self):
        """transformers' own tokenizer of the folder, loaded once (imports transformers)."""
        with self._lock:
            if self._full is None:
                from kvsnap.models.resolve import quiet_transformers

                quiet_transformers()
                from transformers.tokenization_utils_tokenizers import TokenizersBackend

                self._full = TokenizersBackend.from_pretrained(self.name_or_path)
            return self._full

    def preload(self) -> None:
        """Make ready in a background thread now what renders the chat template (a chat will render it
        soon: the work then overlaps the user's typing instead of delaying the first answer): the
        compiled template, or ``full`` where transformers must render it."""
        from kvsnap.models import chat_jinja

        if self.chat_template and chat_jinja.supported(self.chat_template):
            target = lambda: chat_jinja.compiled(self.chat_template)  # noqa: E731
        elif self._full is None:
            target = lambda: self.full  # noqa: E731
        else:
            return

        def work() -> None:
            # A failure here is the render's to report, when the chat renders (not a traceback in the
            # chat's terminal from this thread).
            with contextlib.suppress(Exception):
                target()

        threading.Thread(target=work, name="kvsnap-tokenizer", daemon=True).start()

    def apply_chat_template(
        self, conversation, *args, tokenize: bool = True, add_generation_prompt: bool = False, **kwargs
    ):
        """transformers' ``apply_chat_template``; a plain chat rendered as text (what kvsnap asks for)
        renders here without transformers (``kvsnap.models.chat_jinja``)."""
        from kvsnap.models import chat_jinja

        template = self.chat_template
        here = not args and not tokenize and not kwargs and template and chat_jinja.supported(template)
        if here and chat_jinja.plain(conversation):
            return chat_jinja.render(template, conversation, add_generation_prompt, self.special_tokens_map)
        return self.full.apply_chat_template(
            conversation, *args, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.full, name)

    # -- encoding and decoding: the Rust tokenizer, as TokenizersBackend calls it

    def __call__(
        self,
        text,
        add_special_tokens: bool = True,
        return_offsets_mapping: bool = False,
        split_special_tokens: bool = False,
        **kwargs: Any,
    ):
        if not isinstance(text, str) or kwargs:
            return self.full(
                text,
                add_special_tokens=add_special_tokens,
                return_offsets_mapping=return_offsets_mapping,
                split_special_tokens=split_special_tokens,
                **kwargs,
            )
        enc = self._encode(text, add_special_tokens, split_special_tokens)
        out = {"input_ids": enc.ids, "attention_mask": enc.attention_mask}
        if return_offsets_mapping:
            out["offset_mapping"] = enc.offsets
        return out

    def _encode(self, text: str, add_special_tokens: bool, split_special_tokens: bool):
        tok = self._splitting() if split_special_tokens else self._tok
        if len(text) > RELEASE_GIL_CHARS:
            # encode holds the GIL for the whole text (seconds for a megabyte, while no other thread
            # runs: a server's event loop); encode_batch, what transformers calls, lets go of it.
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        # A short text stays on encode: it never marks the process as having used the tokenizers
        # thread pool, which makes every later fork print a warning.
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def _splitting(self):
        """A second copy of the tokenizer that keeps special-token text as text: the setting lives on
        the tokenizer object, and flipping it on the shared one would race a concurrent encode."""
        with self._split_lock:
            if self._split is None:
                from tokenizers import Tokenizer

                self._split = Tokenizer.from_str(self._tok.to_str())
                self._split.encode_special_tokens = True
            return self._split

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._encode(text, add_special_tokens, False).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.full.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(token_ids, "tolist"):  # a tensor or an array, as transformers takes them
            token_ids = token_ids.tolist()
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self._tok.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    # -- special tokens

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tok.get_added_tokens_decoder()

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self._named.values()))

    def _named_id(self, name: str) -> int | None:
        token = self._named.get(name)
        return None if token is None else self._tok.token_to_id(token)

    bos_token = property(lambda self: self._named.get("bos_token"))
    eos_token = property(lambda self: self._named.get("eos_token"))
    unk_token = property(lambda self: self._named.get("unk_token"))
    pad_token = property(lambda self: self._named.get("pad_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))


def longest_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the bytes of text one token stands for: the longest token's UTF-8 length as
    the vocabulary spells it (a byte-level BPE spells a byte in one character of one or two bytes,
    SentencePiece a space as the 3-byte "\u2581", a raw byte as "<0x0A>": never fewer bytes than
    the text). A text longer than ``context x this`` cannot fit the context. None when the
    tokenizer has no vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=0)
    except Exception:  # a tokenizer of another kind: no bound, the caller's byte caps still hold
        return None
    return longest or None
