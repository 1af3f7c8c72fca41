"""Performance profiles: how long an engine iteration takes on a given model and GPU.

One roofline, shared by the engine model (emulator and simulator) and the router's SLO model.
An iteration runs a batch of prefill chunks and decode steps; its time is

    t = overhead + max(FLOPs / (peak_flops x mfu), bytes / (hbm_bandwidth x mbu))

* FLOPs: 2 x active parameters per token (linear layers) for every prefill and decode token, plus
  attention: 4 x layers x q_heads x head_dim per (token, context token) pair.
* bytes: the weights read once per iteration (for a MoE, the shared part plus the experts the
  batch's tokens touch: each expert is hit with probability 1 - (1 - k/E)^tokens), plus the KV
  cache every decode step reads (context tokens x KV bytes per token).
* ``mfu`` / ``mbu``: the fractions of peak compute and bandwidth real kernels reach; ``overhead``:
  scheduling and kernel launches per iteration. They are calibrated per preset against published
  measurements (``PRESETS`` and the README say which and how close).

Moving KV costs ``tokens x kv_bytes_per_token / bandwidth + latency`` (global tier loads, PD
transfers). KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelArch:
    name: str
    params: float
    """All parameters (what the weights take in memory)."""
    active_params: float
    """Parameters one token goes through (= params for a dense model)."""
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    experts: int = 0
    """Routed experts per MoE layer (0 for dense)."""
    experts_per_token: int = 0
    expert_params: float = 0.0
    """Parameters in all routed experts together."""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one iteration over ``tokens`` tokens reads from HBM."""
        if not self.experts or tokens <= 0:
            return self.weight_bytes
        shared = self.params - self.expert_params
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens
        return (shared + self.expert_params * touched) * self.dtype_bytes


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""
    hbm_bytes_per_s: float
    hbm_bytes: float


@dataclass(frozen=True)
class Profile:
    """A model on a GPU, with the efficiencies that turn the roofline into real times."""

    name: str
    model: ModelArch
    gpu: GPU
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.003
    mem_fraction_static: float = 0.88
    """Share of HBM for weights + KV pool (SGLang's ``--mem-fraction-static``)."""
    calibration: str = ""
    """Where the efficiencies come from (the checks are in ``smetric.calibration``)."""

    def __post_init__(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError(f"profile {self.name}: mfu and mbu must be in (0, 1]")
        if self.overhead_s < 0 or not (0 < self.mem_fraction_static <= 1):
            raise ValueError(f"profile {self.name}: bad overhead_s or mem_fraction_static")

    # ---- derived -------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def kv_pool_tokens(self) -> int:
        """KV tokens the pool holds: HBM share left after the weights."""
        free = self.gpu.hbm_bytes * self.mem_fraction_static - self.model.weight_bytes
        return max(int(free // self.kv_bytes_per_token), 0)

    def _attention_flops(self, pairs: float) -> float:
        m = self.model
        return 4.0 * m.layers * m.q_heads * m.head_dim * pairs

    # ---- the roofline --------------------------------------------------------------------

    def iteration_time_s(
        self,
        prefill: Iterable[tuple[int, int]] = (),
        decode_requests: int = 0,
        decode_context_tokens: int = 0,
    ) -> float:
        """Time of one iteration.

        ``prefill``: (new tokens, tokens already in context before them) per prefill chunk.
        ``decode_requests``: requests taking one decode step; ``decode_context_tokens``: their
        context tokens in total (what their attention reads).
        """
        m = self.model
        new_tokens = 0
        pairs = 0.0
        for n, ctx in prefill:
            new_tokens += n
            pairs += n * ctx + n * (n + 1) / 2.0  # each new token attends to all before it
        tokens = new_tokens + decode_requests
        if tokens == 0:
            return 0.0
        flops = 2.0 * m.active_params * tokens
        flops += self._attention_flops(pairs + decode_context_tokens)
        hbm = m.weight_bytes_read(tokens) + decode_context_tokens * self.kv_bytes_per_token
        compute_s = flops / (self.gpu.bf16_flops * self.mfu)
        memory_s = hbm / (self.gpu.hbm_bytes_per_s * self.mbu)
        return self.overhead_s + max(compute_s, memory_s)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One iteration prefilling ``new_tokens`` after ``cached_tokens`` (no decode)."""
        return self.iteration_time_s([(new_tokens, cached_tokens)])

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` in total."""
        return self.iteration_time_s((), batch, context_tokens)

    def kv_move_time_s(self, tokens: int, bytes_per_s: float, latency_s: float) -> float:
        """Moving the KV of ``tokens`` over a link (global tier, PD transfer)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / bytes_per_s + latency_s

    # ---- files ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Profile:
        try:
            return Profile(
                **{
                    **d,
                    "model": ModelArch(**d["model"]),
                    "gpu": GPU(**d["gpu"]),
                }
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a profile: {e}") from e


def load_profile(name_or_path: str) -> Profile:
    """A preset by name, or a profile JSON file (the format ``Profile.to_json`` writes)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(
            f"unknown profile {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a file"
        )
    return Profile.from_dict(json.loads(path.read_text()))


# ---- presets ------------------------------------------------------------------------------

H100 = GPU("H100-SXM-80GB", bf16_flops=989e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9)
H200 = GPU("H200-141GB", bf16_flops=989e12, hbm_bytes_per_s=4.8e12, hbm_bytes=141e9)
H20 = GPU("H20-96GB", bf16_flops=148e12, hbm_bytes_per_s=4.0e12, hbm_bytes=96e9)

LLAMA_31_8B = ModelArch(
    "llama-3.1-8b",
    params=8.03e9,
    active_params=8.03e9,
    layers=32,
    hidden=4096,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
)
QWEN25_7B = ModelArch(
    "qwen2.5-7b",
    params=7.62e9,
    active_params=7.62e9,
    layers=28,
    hidden=3584,
    q_heads=28,
    kv_heads=4,
    head_dim=128,
)
# 128 routed experts of 3 x 2048 x 768 weights in each of 48 layers, 8 active per token.
QWEN3_30B_A3B = ModelArch(
    "qwen3-30b-a3b",
    params=30.5e9,
    active_params=3.3e9,
    layers=48,
    hidden=2048,
    q_heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    experts_per_token=8,
    expert_params=48 * 128 * 3 * 2048 * 768,
)

# Efficiencies fitted to published measurements (smetric.calibration; scripts/fit_profile.py).
# Dense presets share one setting, fitted to the two dense figures together; the MoE preset has
# its own (MoE kernels at small batch reach far less of the bandwidth).
DENSE = {"mfu": 0.5, "mbu": 0.72, "overhead_s": 0.0015}
MOE_H20 = {"mfu": 0.5, "mbu": 0.5, "overhead_s": 0.004}

PRESETS: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "llama-3.1-8b-h100",
            LLAMA_31_8B,
            H100,
            **DENSE,
            calibration="dense setting; checked on NIM's FP8 ITL (see README)",
        ),
        Profile(
            "qwen2.5-7b-h200",
            QWEN25_7B,
            H200,
            **DENSE,
            calibration="dense setting; checked on vLLM's Llama-3.1-8B H200 latency",
        ),
        Profile(
            "qwen3-30b-a3b-h20",
            QWEN3_30B_A3B,
            H20,
            **MOE_H20,
            calibration="fitted to Qwen's SGLang speed benchmark on H20 (4 points)",
        ),
    )
}
"""Named profiles. Aliases by model name: ``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-30b-a3b``."""

for _alias, _full in (
    ("llama-3.1-8b", "llama-3.1-8b-h100"),
    ("qwen2.5-7b", "qwen2.5-7b-h200"),
    ("qwen3-30b-a3b", "qwen3-30b-a3b-h20"),
):
    PRESETS[_alias] = PRESETS[_full]

DEFAULT_PROFILE = "qwen2.5-7b-h200"
