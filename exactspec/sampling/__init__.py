"""Pure, batched sampling mathematics: standardized distributions, verification, random streams.

`params` / `standardize` / `history`: SamplingParams and p, q from logits. `methods`: the verify
methods as objects (token, block, traversal, greedy, lenient:L, typical:EPS), parsed once from
their names. `verify`: the entry points (verify, acceptance_law, verify_tree, ...); the rules
are in `chain` (token, block, greedy), `lossy` (lenient, typical) and `tree_verify` (trees, on
`tree`'s DraftTree); `checks` validates their inputs. `coupled`: coupled verification (one uniform per output
position for draft and target). `streams`: the random streams.
Imports nothing from the rest of exactspec but its errors (docs/sampling.md).
"""

from exactspec.sampling.chain import AcceptanceLaw, Verdict
from exactspec.sampling.methods import (
    LOSSY_RULES,
    METHODS,
    TREE_METHODS,
    LossyRule,
    VerifyMethod,
    is_lossless,
    parse_lossy,
    parse_method,
)
from exactspec.sampling.params import SamplingParams
from exactspec.sampling.standardize import probs_from_logits
from exactspec.sampling.streams import (
    DOMAIN_ACCEPT,
    DOMAIN_DRAFT,
    DOMAIN_POSITION,
    DOMAIN_RESAMPLE,
    DOMAIN_SAMPLE,
    Randomness,
    RowStreams,
    position_uniforms,
    sample,
    sample_from_weights,
    uniforms,
)
from exactspec.sampling.tree import SIBLING_KINDS, DraftTree, branching_parents, tree_history
from exactspec.sampling.tree_verify import TreeLaw, TreeVerdict
from exactspec.sampling.verify import acceptance_law, tree_acceptance_law, verify, verify_tree

__all__ = [
    "DOMAIN_ACCEPT", "DOMAIN_DRAFT", "DOMAIN_RESAMPLE", "DOMAIN_SAMPLE", "LOSSY_RULES", "METHODS",
    "AcceptanceLaw", "LossyRule", "Randomness", "RowStreams", "SamplingParams", "Verdict",
    "VerifyMethod", "acceptance_law", "is_lossless", "parse_lossy", "parse_method",
    "probs_from_logits", "sample",
    "sample_from_weights", "uniforms", "verify",
]
__all__ += ["DOMAIN_POSITION", "position_uniforms"]
__all__ += ["SIBLING_KINDS", "TREE_METHODS", "DraftTree", "TreeLaw", "TreeVerdict",
            "branching_parents", "tree_acceptance_law", "tree_history", "verify_tree"]
