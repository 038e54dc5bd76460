"""KV memory planning: how many blocks fit in the budget, and the start-up lines about it.

    bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype bytes

A request of L tokens holds ceil(L / block_size) whole blocks, so the memory one request at
``max_model_len`` needs is counted in whole blocks too. When that does not fit, start-up fails
with the needed and available GiB, the largest max_model_len that would fit (binary search),
and the flags that fix it (--max-model-len, and --kv-cache-memory or, on CUDA,
--gpu-memory-utilization).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20


def gib_text(num_bytes: int) -> str:
    """A size as vLLM's lines say it (``4.50 GiB``), with MiB where two decimals of GiB say
    little (``0.02 GiB (16.0 MiB)``), as a small CPU cache is."""
    text = f"{num_bytes / GIB:.2f} GiB"
    return f"{text} ({num_bytes / MIB:.1f} MiB)" if 0 < num_bytes < GIB // 10 else text


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_for_tokens(num_tokens: int, bytes_per_token: int, block_size: int) -> int:
    """KV memory one request of ``num_tokens`` tokens holds (whole blocks)."""
    return cdiv(num_tokens, block_size) * block_size * bytes_per_token


def estimate_max_model_len(
    bytes_per_token: int, available_bytes: int, block_size: int, upper: int
) -> int:
    """The largest length in [0, upper] whose KV memory fits in ``available_bytes``."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if kv_bytes_for_tokens(mid, bytes_per_token, block_size) <= available_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def cuda_kv_budget_bytes(
    total_bytes: int, gpu_memory_utilization: float, weights_bytes: int, activation_peak_bytes: int
) -> int:
    """KV budget on CUDA: the allowed share of the card minus weights and activation peak."""
    budget = int(total_bytes * gpu_memory_utilization) - weights_bytes - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_memory_utilization:.2f} x "
            f"{total_bytes / GIB:.2f} GiB minus weights ({weights_bytes / GIB:.2f} GiB) and "
            f"activation peak ({activation_peak_bytes / GIB:.2f} GiB) is {budget / GIB:.2f} "
            "GiB; raise gpu_memory_utilization (--gpu-memory-utilization) or lower "
            "max_num_batched_tokens (--max-num-batched-tokens)"
        )
    return budget


@dataclass(frozen=True)
class KvPlan:
    bytes_per_token: int
    block_size: int
    available_bytes: int
    num_blocks: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, request_len: int | None = None) -> float:
        """How many requests of ``request_len`` tokens (default max_model_len) fit at once."""
        request_len = request_len or self.max_model_len
        return self.num_tokens / (cdiv(request_len, self.block_size) * self.block_size)

    def startup_lines(self, request_len: int | None = None) -> list[str]:
        request_len = request_len or self.max_model_len
        return [
            f"Available KV cache memory: {gib_text(self.available_bytes)}",
            f"KV cache size: {self.num_tokens:,} tokens",
            f"Maximum concurrency for {request_len:,} tokens per request: "
            f"{self.max_concurrency(request_len):.2f}x",
        ]


def plan_kv_cache(
    bytes_per_token: int,
    available_bytes: int,
    block_size: int,
    max_model_len: int,
    memory_setting: str = "kv_cache_memory_bytes (--kv-cache-memory)",
) -> KvPlan:
    """Blocks that fit in ``available_bytes``; ValueError when one max-length request does not.

    ``memory_setting`` names the setting that gives the cache more memory on this device.
    """
    for name, value in (
        ("bytes_per_token", bytes_per_token),
        ("block_size", block_size),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    needed_bytes = kv_bytes_for_tokens(max_model_len, bytes_per_token, block_size)
    if needed_bytes > available_bytes:
        estimate = estimate_max_model_len(
            bytes_per_token, available_bytes, block_size, max_model_len
        )
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{gib_text(needed_bytes)} KV cache is needed, which is larger than the "
            f"available KV cache memory ({gib_text(max(available_bytes, 0))}). Based on "
            f"the available memory, the estimated maximum model length is {estimate}. Try "
            f"increasing {memory_setting} or decreasing max_model_len (--max-model-len)."
        )
    num_blocks = available_bytes // (block_size * bytes_per_token)
    return KvPlan(bytes_per_token, block_size, available_bytes, num_blocks, max_model_len)
