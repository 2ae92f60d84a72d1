"""Private Triton kernels and their launch plan (see ``launch``)."""
import os


_ENV_STORE = getattr(os.environ, "_data", None)  # CPython's store behind os.environ (its setters keep it current)
_ENV_KEYS: dict = {}  # name -> its key in that store


def env_get(name: str, default=None):
    """``os.environ.get(name, default)`` without its cost on every call: an unset name costs ``os.environ.get`` a
    raised and caught KeyError (~0.8 us), a dict lookup in os.environ's own store ~0.04 us. Sees every change made
    through ``os.environ`` (which updates that store), as ``os.environ.get`` does."""
    if _ENV_STORE is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    raw = _ENV_STORE.get(key)
    return default if raw is None else os.environ.decodevalue(raw)


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, read at call time;
    Triton itself reads it when the kernels are defined, at ``import mxmoe``)."""
    return env_get("TRITON_INTERPRET", "0") not in ("", "0")


def wide_tail_steps(block_k: int, num_stages: int, scale_bytes: int = 4) -> int:
    """K steps a wide tile unrolls at its end (``sm90_wide._wide_tail_steps``; ``config`` and the kernel both read
    it): its last num_stages - 1, rounded up to whole scale loads (``scale_bytes`` K32 blocks each: 4, a 32-bit word,
    where K % 128 == 0; else 2)."""
    per_load = max(32 * scale_bytes // block_k, 1)  # (a step wider than a load: refused by GemmConfig.validate)
    return per_load * -(-(num_stages - 1) // per_load)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for the host side (that one is a constexpr function: ~1 us per call)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
