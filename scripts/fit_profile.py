"""Fits a preset's efficiencies (mfu, mbu, overhead) to its published checks by grid search,
minimising the largest relative error. Prints the best few; the chosen values go into PRESETS.

    python scripts/fit_profile.py qwen3-30b-a3b-h20
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

from smetric.calibration import CHECKS
from smetric.perf import PRESETS


def main(preset: str, fixed_mfu: float | None = None) -> None:
    checks = [c for c in CHECKS if c.preset == preset]
    base = PRESETS[preset]
    mfus = [fixed_mfu] if fixed_mfu else [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    mbus = [x / 20 for x in range(6, 19)]
    overheads = [x / 4000 for x in range(0, 33)]
    results = []
    for mfu, mbu, ovh in itertools.product(mfus, mbus, overheads):
        profile = replace(base, mfu=mfu, mbu=mbu, overhead_s=ovh)
        errs = []
        for c in checks:
            model = c.scenario(c.profile(profile))
            errs.append((model - c.published) / c.published)
        results.append((max(abs(e) for e in errs), mfu, mbu, ovh, errs))
    results.sort()
    for worst, mfu, mbu, ovh, errs in results[:5]:
        print(
            f"worst {worst:.1%}  mfu {mfu}  mbu {mbu}  overhead {ovh * 1e3:.2f} ms  "
            + " ".join(f"{e:+.1%}" for e in errs)
        )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
