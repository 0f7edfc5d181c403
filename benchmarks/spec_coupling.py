"""How the shared sampling noise couples the draft and the target: the acceptance rate of Miles' verification
(accept the draft token when it equals the target's own sample under the same noise) for two couplings, against
the best any verifier can do (rejection sampling's bound, 1 - TV(p, q)).

- inverse CDF (the sampler today, `miles_kernels/ops/sampling.py`): one uniform u per (seed, position); each model
  picks the token whose CDF interval (token-id order) holds u. Same token iff u falls in both models' interval
  of that token: P = sum_i |[P_{i-1}, P_i) ∩ [Q_{i-1}, Q_i)|, computed exactly.
- Gumbel-max: one Gumbel variable per (seed, position, token); each model picks argmax(log p_i + g_i). Estimated
  by Monte Carlo (`--draws` draws per pair).

Pairs: target logits ~ N(0, scale²) over `--vocab` tokens; the draft's are the target's plus N(0, sigma²) noise,
for several sigmas (a good draft: small sigma). Writes JSON (`--out`).

    uv run python benchmarks/spec_coupling.py --out benchmarks/results/spec_coupling.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from host import host_info


def inverse_cdf_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    cp, cq = torch.cumsum(p, 0), torch.cumsum(q, 0)
    lo = torch.maximum(cp - p, cq - q)
    hi = torch.minimum(cp, cq)
    return float((hi - lo).clamp(min=0).sum())


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> float:
    u = torch.rand(draws, p.shape[0], generator=generator, dtype=torch.float64).clamp(1e-300, 1.0)
    g = -torch.log(-torch.log(u))
    return float((torch.argmax(p.log() + g, 1) == torch.argmax(q.log() + g, 1)).double().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--scale", type=float, default=3.0, help="std of the target's logits (peakiness)")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--out", default="benchmarks/results/spec_coupling.json")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for sigma in (0.1, 0.3, 1.0, 2.0):
        bound = inverse = gumbel = entropy = 0.0
        for _ in range(args.pairs):
            logits = torch.randn(args.vocab, generator=generator, dtype=torch.float64) * args.scale
            p = torch.softmax(logits, 0)
            q = torch.softmax(logits + sigma * torch.randn(args.vocab, generator=generator, dtype=torch.float64), 0)
            bound += 1.0 - 0.5 * float((p - q).abs().sum())
            inverse += inverse_cdf_agreement(p, q)
            gumbel += gumbel_agreement(p, q, args.draws, generator)
            entropy += float(-(p * p.log()).sum())
        n = args.pairs
        rows.append({
            "draft_noise_sigma": sigma, "target_entropy_nats": entropy / n, "one_minus_tv": bound / n,
            "inverse_cdf": inverse / n, "gumbel_max": gumbel / n,
        })  # fmt: skip
        print(rows[-1])
    out = {
        "what": "P(draft token == target token) per position under each coupling of the shared noise, vs 1 - TV",
        "command": "uv run python benchmarks/spec_coupling.py",
        "settings": vars(args),
        "host": host_info(),
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
