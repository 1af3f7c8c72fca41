"""Published measurements the performance presets are checked against.

Each check replays the measurement's scenario through the engine model (on the simulator's
clock) and compares the model's number with the published one. ``python -m smetric.calibration``
prints the table the README shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from smetric import BlockKeys
from smetric.perf import GPU, H200, LLAMA_31_8B, PRESETS, Profile
from smetric.sim import SimRequest, round_robin, simulate


@dataclass(frozen=True)
class Check:
    preset: str
    what: str
    source: str
    published: float
    unit: str
    scenario: Callable[[Profile], float]
    profile: Callable[[Profile], Profile] = lambda p: p
    """How the measured setup differs from the preset (another GPU, another dtype)."""


def _requests(batch: int, prompt: int, output: int) -> list[SimRequest]:
    return [
        SimRequest(
            f"r{i}",
            prompt,
            output,
            BlockKeys.from_ids(range(i << 32, (i << 32) + prompt // 16)),
            16,
            arrival_s=0.0,
        )
        for i in range(batch)
    ]


def _mean(field: str, batch: int, prompt: int, output: int) -> Callable[[Profile], float]:
    """A scenario: ``batch`` equal requests at once on one idle worker; the mean of a latency."""

    def run(profile: Profile) -> float:
        res = simulate(
            _requests(batch, prompt, output), round_robin(), profile, workers=1, global_tier=None
        )
        return sum(getattr(r, field) or 0.0 for r in res.requests) / batch

    return run


def mean_e2e_s(batch: int, prompt: int, output: int) -> Callable[[Profile], float]:
    return _mean("e2e_s", batch, prompt, output)


def mean_tpot_s(batch: int, prompt: int, output: int) -> Callable[[Profile], float]:
    return _mean("tpot_s", batch, prompt, output)


QWEN_SPEED = (
    "Qwen speed benchmark (qwen.readthedocs.io, getting_started/speed_benchmark, table "
    "'Qwen3-30B-A3B (SGLang)'): one H20, SGLang 0.4.6.post1, BF16, batch 1, 2,048 tokens "
    "generated; published as (input + output) tokens / s, converted here to seconds"
)


def _on_h200(p: Profile) -> Profile:
    return replace(p, name="llama-3.1-8b-h200", model=LLAMA_31_8B, gpu=H200)


def _fp8(p: Profile) -> Profile:
    gpu = p.gpu
    fp8_gpu = GPU(gpu.name + "-fp8", gpu.bf16_flops * 2, gpu.hbm_bytes_per_s, gpu.hbm_bytes)
    return replace(p, name=p.name + "-fp8", model=replace(p.model, dtype_bytes=1), gpu=fp8_gpu)


CHECKS: list[Check] = [
    *[
        Check(
            "qwen3-30b-a3b-h20",
            f"batch 1, {prompt:,} in / 2,048 out: total time",
            QWEN_SPEED,
            (prompt + 2048) / tps,
            "s",
            mean_e2e_s(1, max(prompt, 1), 2048),
        )
        for prompt, tps in ((1, 137.18), (6144, 490.10), (14336, 849.62), (30720, 1283.94))
    ],
    Check(
        "qwen2.5-7b-h200",
        "Llama-3.1-8B (the nearest published dense model) on H200, batch 8, 32 in / 128 out: "
        "mean end-to-end latency",
        "vLLM CI benchmarks (Buildkite run #9515, latency test, H200, TP 1); no Qwen2.5-7B on "
        "H200 figure was found, so this checks the H200 dense efficiencies the preset uses",
        0.8334,
        "s",
        mean_e2e_s(8, 32, 128),
        _on_h200,
    ),
    Check(
        "llama-3.1-8b-h100",
        "FP8 variant, concurrency 1: inter-token latency",
        "NVIDIA NIM LLM benchmarking page (docs.nvidia.com/nim/benchmarking/llm, "
        "Llama-3.1-8b-instruct, NIM 1.8.0, concurrency 1: ITL 4.63 ms); the page's precision is "
        "not stated; 4.63 ms is below the BF16 weight-read floor (16 GB / 3.35 TB/s = 4.8 ms), "
        "so it is checked as FP8 weights and KV with FP8 peak compute; no BF16 batch-1 figure "
        "was found",
        0.00463,
        "s",
        mean_tpot_s(1, 1000, 256),
        _fp8,
    ),
]


def run_checks() -> list[tuple[Check, float, float]]:
    """(check, model value, relative error) for every check."""
    out = []
    for check in CHECKS:
        profile = check.profile(PRESETS[check.preset])
        model = check.scenario(profile)
        out.append((check, model, (model - check.published) / check.published))
    return out


def table() -> str:
    rows = [
        "| preset | scenario | published | model | error |",
        "|---|---|---|---|---|",
    ]
    for check, model, err in run_checks():
        scale = 1000.0 if check.published < 1 else 1.0
        unit = "ms" if scale == 1000.0 else check.unit
        rows.append(
            f"| `{check.preset}` | {check.what} | {check.published * scale:.2f} {unit} | "
            f"{model * scale:.2f} {unit} | {err:+.1%} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print()
    for check in CHECKS:
        print(f"- {check.preset}: {check.source}")
