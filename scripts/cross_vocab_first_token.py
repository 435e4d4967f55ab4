"""The issue-15 target on the real pair at full size: the first token's law at T = 1 through
`generate` (target gemma3-270m, `CrossVocabDraft` of smollm2-135m, TLI, K = 1) against the
target's exact first-token p, chi-square at false-alarm 1e-6 over ROWS rows (default 2,000),
and the same test on a wrong variant (draws at temperature 1/2, reports q at 1), which must be
rejected. The suite runs the same check with 400 / 300 rows (tests/drafters/
test_cross_vocab_real.py); this is the 2,000-row run (~4 CPU-minutes on 2 cores).

    PYTHONPATH=. .venv/bin/python scripts/cross_vocab_first_token.py --rows 2000 --threads 2
"""

from __future__ import annotations

import argparse

import torch

import exactspec as es
from exactspec.audit.stats import chi_square, power
from exactspec.drafters import CrossVocabDraft
from tests.drafters.test_cross_vocab_real import (
    FIRST_PROMPT,
    SharpenedSampling,
    first_token_counts,
    first_token_laws,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--prompt", default=FIRST_PROMPT)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = es.load("gemma3-270m"), es.load("smollm2-135m")
    p, wrong_law = first_token_laws(target, draft, args.prompt)
    print(f"prompt {args.prompt!r}, {args.rows} rows, T = 1, K = 1; wrong variant: TV "
          f"{0.5 * float((wrong_law - p).abs().sum()):.3f} from p, power "
          f"{power(p, wrong_law, args.rows):.6f}")
    for name, drafter, seed in (("TLI", CrossVocabDraft(draft), 11),
                                ("wrong (q at T=1, drawn at T=1/2)", SharpenedSampling(draft), 12)):
        counts, accepted = first_token_counts(target, drafter, args.prompt, args.rows, seed)
        r = chi_square(counts, p)
        print(f"{name}: X^2 = {r.statistic:.1f}, dof {r.dof}, threshold {r.threshold:.1f}, "
              f"p-value {r.p_value:.3g}, {'REJECTED' if r.rejected else 'not rejected'}; "
              f"first draft accepted in {accepted} of {args.rows} rows")


if __name__ == "__main__":
    main()
