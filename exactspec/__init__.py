"""exactspec: lossless speculative decoding, with an audit that proves it.

p is always the target distribution and q the draft distribution (Leviathan et al. 2023).
"""

from exactspec.sampling import SamplingParams, Verdict, probs_from_logits, verify

__all__ = ["SamplingParams", "Verdict", "probs_from_logits", "verify"]
__version__ = "0.1.0"
