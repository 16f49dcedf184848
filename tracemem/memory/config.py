"""``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` strings, parsed as PyTorch 2.13 does.

Source (torch 2.13.0, git cf30153c): the tokenizer is ``c10::CachingAllocator::ConfigTokenizer``
(c10/core/AllocatorConfig.h: ``,``, ``:``, ``[`` and ``]`` are tokens, whitespace is dropped);
the device keys are parsed by ``AcceleratorAllocatorConfig::parseArgs``
(c10/core/AllocatorConfig.cpp: ``parseLargeSegmentSize``, ``parseMaxSplitSize``,
``parseMaxNonSplitRoundingSize``, ``parseGarbageCollectionThreshold``,
``parseRoundUpPower2Divisions``, ``parseExpandableSegments``) and the CUDA keys by
``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp), which rejects a key that
neither parser knows ("Unrecognized key ... in CUDA allocator config"). The key names below are
those of ``AcceleratorAllocatorConfig::getKeys()`` and ``CUDAAllocatorConfig::getKeys()``
(c10/cuda/CUDAAllocatorConfig.h, installed with the 2.13 wheel).

Stricter than PyTorch, on purpose: numbers must be plain decimal digits (``std::stoull``
would accept ``"12abc"`` as 12 and wrap ``"-1"``), and every error is one line naming the key,
the value and what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracemem.errors import TracememError

__all__ = ["AllocatorConfig", "parse_alloc_conf", "MiB", "KEYS"]

MiB = 2**20
# kLargeBuffer / AcceleratorAllocatorConfig::large_segment_size_ default (AllocatorConfig.h)
_LARGE_SEGMENT_DEFAULT = 20 * MiB
# kMinLargeAlloc (AllocatorConfig.h): large_segment_size_mb must exceed it (parseLargeSegmentSize)
_MIN_LARGE_ALLOC = 10 * MiB
# kRoundUpPowerOfTwoIntervals (AllocatorConfig.cpp): 16 intervals, 1 MiB .. 64 GiB
_INTERVALS = 16

# keys that change what the device allocator does, and the rest (host / pinned memory, locking,
# graph capture, errors), which a single-stream replay of device memory does not see
_DEVICE_KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                "garbage_collection_threshold", "roundup_power2_divisions",
                "expandable_segments", "per_process_memory_fraction", "backend")
_NO_EFFECT_BOOL = ("pinned_use_background_threads", "release_lock_on_cudamalloc",
                   "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                   "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
                   "pinned_free_catch_all", "throw_on_cudamalloc_oom")
_NO_EFFECT_INT = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")
KEYS = tuple(sorted(_DEVICE_KEYS + _NO_EFFECT_BOOL + _NO_EFFECT_INT))


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching-allocator settings the simulator uses (bytes are int).

    Attributes:
        max_split_size: blocks of this size or more are never split; None = unlimited
            (PyTorch's SIZE_MAX default).
        max_non_split_rounding_size: a request >= max_split_size may take a cached oversize
            block smaller than request + this (default ``large_segment_size``, 20 MiB).
        large_segment_size: the segment made for a 1-10 MiB request, and the page of an
            expandable large-pool segment (default 20 MiB, ``kLargeBuffer``).
        roundup_power2_divisions: 16 division counts, one per power-of-two interval from
            1 MiB (index 0: sizes < 2 MiB) to 32 GiB and up (index 15); 0 or 1 = no rounding.
        garbage_collection_threshold: fraction in (0, 1), or 0 (off).
        expandable_segments: one growing segment per pool.
        per_process_memory_fraction: None, or the fraction of device memory the allocator may
            reserve (``torch.cuda.set_per_process_memory_fraction``).
        text: the string parsed; ignored: keys given that do not affect device memory.
    """

    max_split_size: int | None = None
    max_non_split_rounding_size: int = _LARGE_SEGMENT_DEFAULT
    large_segment_size: int = _LARGE_SEGMENT_DEFAULT
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    text: str = ""
    ignored: tuple[str, ...] = field(default=())


def _tokens(text: str) -> list[str]:
    # ConfigTokenizer (c10/core/AllocatorConfig.h)
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.tok = _tokens(text)
        self.i = 0

    def fail(self, message: str) -> TracememError:
        return TracememError(f"--alloc-conf {self.text!r}: {message}")

    def take(self, what: str) -> str:
        if self.i >= len(self.tok):
            raise self.fail(f"expected {what} at the end")
        token = self.tok[self.i]
        self.i += 1
        return token

    def expect(self, ch: str, after: str) -> None:
        token = self.take(f"'{ch}' after {after}")
        if token != ch:
            raise self.fail(f"expected '{ch}' after {after}, got {token!r}")

    def integer(self, key: str) -> int:
        token = self.take(f"a value for {key}")
        if not token.isdigit():
            raise self.fail(f"{key} needs a non-negative integer, got {token!r}")
        return int(token)

    def boolean(self, key: str) -> bool:
        # ConfigTokenizer::toBool: exactly "True" or "False"
        token = self.take(f"a value for {key}")
        if token not in ("True", "False"):
            raise self.fail(f"{key} needs True or False (capitalised, as PyTorch's "
                            f"ConfigTokenizer::toBool), got {token!r}")
        return token == "True"

    def number(self, key: str) -> float:
        token = self.take(f"a value for {key}")
        try:
            return float(token)
        except ValueError:
            raise self.fail(f"{key} needs a number, got {token!r}") from None


def _divisions(r: _Reader, current: list[int]) -> list[int]:
    # AcceleratorAllocatorConfig::parseRoundUpPower2Divisions (AllocatorConfig.cpp)
    key = "roundup_power2_divisions"
    out = list(current)
    if r.i < len(r.tok) and r.tok[r.i] == "[":
        r.i += 1
        first, last_index = True, 0
        while True:
            boundary = r.take(f"']' closing {key}")
            if boundary == "]":
                break
            r.expect(":", f"{key} interval {boundary!r}")
            value = r.integer(key)
            if value != 0 and not _is_pow2(value):
                raise r.fail(f"{key}: divisions must be a power of 2 or 0, got {value}")
            if boundary == ">":
                out[last_index + 1:] = [value] * (len(out) - last_index - 1)
            else:
                if not boundary.isdigit() or not _is_pow2(int(boundary)):
                    raise r.fail(f"{key}: intervals must be powers of 2 (MiB), got "
                                 f"{boundary!r}")
                index = min(int(boundary).bit_length() - 1, _INTERVALS - 1)
                if first:
                    out[:index] = [value] * index
                    first = False
                out[index] = value
                last_index = index
            if r.i < len(r.tok) and r.tok[r.i] == ",":
                r.i += 1
        return out
    value = r.integer(key)
    if not _is_pow2(value):
        raise r.fail(f"{key}: divisions must be a power of 2, got {value}")
    return [value] * _INTERVALS


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """Parse an allocator setting string, e.g.
    ``"expandable_segments:True,max_split_size_mb:128"``. ``None`` or ``""`` gives the
    defaults.

    Raises:
        TracememError: an unknown key, a malformed string, or a value PyTorch rejects (with
            PyTorch's bound: ``max_split_size_mb`` >= large segment size in MiB (20),
            ``garbage_collection_threshold`` in (0, 1), ...), or ``backend:cudaMallocAsync``,
            which this simulator does not model.
    """
    if text is None or not text.strip():
        return AllocatorConfig()
    if not isinstance(text, str):
        raise TracememError(f"--alloc-conf {text!r} must be a string such as "
                            f"'expandable_segments:True'")
    r = _Reader(text)
    s: dict = {"max_split_size": None, "max_non_split_rounding_size": None,
               "large_segment_size": _LARGE_SEGMENT_DEFAULT,
               "roundup_power2_divisions": [0] * _INTERVALS,
               "garbage_collection_threshold": 0.0, "expandable_segments": False,
               "per_process_memory_fraction": None}
    ignored = []
    while r.i < len(r.tok):
        key = r.take("a key")
        if key not in KEYS:
            raise r.fail(f"unrecognized key {key!r} (PyTorch 2.13 keys: {', '.join(KEYS)})")
        r.expect(":", key)
        large_mb = s["large_segment_size"] // MiB
        if key == "large_segment_size_mb":
            value = r.integer(key)
            if value <= _MIN_LARGE_ALLOC // MiB:
                raise r.fail(f"{key} must be > {_MIN_LARGE_ALLOC // MiB}, got {value}")
            s["large_segment_size"] = value * MiB
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            value = r.integer(key)
            if value < large_mb:  # min_allowed_split_size_mb = large_segment_size_ / kMB
                raise r.fail(f"{key} too small, must be >= {large_mb}, got {value}")
            name = ("max_split_size" if key == "max_split_size_mb"
                    else "max_non_split_rounding_size")
            s[name] = value * MiB
        elif key == "garbage_collection_threshold":
            value = r.number(key)
            if not 0 < value < 1:
                raise r.fail(f"{key} must be in (0.0, 1.0), got {value}")
            s[key] = value
        elif key == "roundup_power2_divisions":
            s[key] = _divisions(r, s[key])
        elif key == "expandable_segments":
            s[key] = r.boolean(key)
        elif key == "per_process_memory_fraction":
            value = r.number(key)
            if not 0 <= value <= 1:
                raise r.fail(f"{key} must be in [0.0, 1.0], got {value}")
            s[key] = value
        elif key == "backend":
            value = r.take("a value for backend")
            if value == "cudaMallocAsync":
                raise r.fail("backend:cudaMallocAsync (CUDA's own pool) is not modelled; "
                             "only the native caching allocator is")
            if value != "native":
                raise r.fail(f"unknown allocator backend {value!r}; options are native and "
                             f"cudaMallocAsync")
        elif key in _NO_EFFECT_BOOL:
            r.boolean(key)
            ignored.append(key)
        else:
            value = r.integer(key)
            if key == "pinned_num_register_threads" and (not _is_pow2(value) or value > 128):
                raise r.fail(f"{key} must be a power of 2 <= 128, got {value}")
            if key == "pinned_reserve_segment_size_mb" and value == 0:
                raise r.fail(f"{key} must be > 0")
            ignored.append(key)
        if r.i < len(r.tok):
            r.expect(",", f"the value of {key}")
            if r.i == len(r.tok):
                raise r.fail("trailing ','")
    if s["max_non_split_rounding_size"] is None:
        # set once in the AcceleratorAllocatorConfig constructor from the default
        # large_segment_size_ (20 MiB); large_segment_size_mb does not move it
        s["max_non_split_rounding_size"] = _LARGE_SEGMENT_DEFAULT
    s["roundup_power2_divisions"] = tuple(s["roundup_power2_divisions"])
    return AllocatorConfig(**s, text=text, ignored=tuple(ignored))
