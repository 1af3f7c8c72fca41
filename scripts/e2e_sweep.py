"""End-to-end peak-TPS sweep: our router (each policy) and sglang-router 0.3.2 (cache_aware,
round_robin, power_of_two) in front of fresh emulated SGLang clusters, on the bundled agent
sessions. See ``smetric.workload.e2e_sweep`` for what it measures.

    python scripts/e2e_sweep.py                      # the full sweep (~15 min on 2 cores)
    python scripts/e2e_sweep.py --routers smetric/smetric sglang-router/cache_aware --ladder 4
"""

from __future__ import annotations

import sys

from smetric.workload.e2e_sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
