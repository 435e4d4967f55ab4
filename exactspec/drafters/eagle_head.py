"""EagleHead: a one-layer draft head over the target's own hidden states (EAGLE / EAGLE-3 style).

At real position s the head reads g_s = fc_in(target features at s, several layers fused) and
the embedding of token s+1, runs one decoder layer (attention over the earlier real positions
of the same row) and predicts the next feature o_s; logits = lm_head(final_norm(o_s)) with the
target's FROZEN final norm and LM head, restricted to a draft vocabulary (`vocab_ids`: the
tokens carrying most of the target's mass), so a draft step costs a few percent of a target
step. Rolling forward (chain depth d >= 2) feeds its own o in place of g, with the drafted
token. Attention at depth d sees the real keys of positions <= s plus the chain's own keys at
depths 2..d (the training-time-test mask of EAGLE-3), the same in training and in decoding.

The frozen parts (embedding, final norm, LM head rows) are attached from the target at run
time with `attach`; only the trainable layer is saved (see `exactspec.drafters.eagle`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from exactspec.errors import InvalidValue


@dataclass
class EagleConfig:
    """Shape of a head; saved as JSON next to its weights."""

    hidden_size: int  # the target's hidden size H
    vocab_size: int  # width of the target's logits V
    num_heads: int  # attention heads of the head's layer
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width
    intermediate_size: int  # SwiGLU MLP width
    hidden_layers: tuple[int, ...] = (-1,)  # indices into the target's output_hidden_states
    rope_theta: float = 10000.0  # rotary base (the target's)
    rms_norm_eps: float = 1e-5  # epsilon of the head's own norms
    draft_vocab_size: int = 0  # len(vocab_ids); 0 = the whole vocabulary
    meta: dict = field(default_factory=dict)  # free-form provenance (target name, recipe)

    def __post_init__(self) -> None:
        self.hidden_layers = tuple(int(i) for i in self.hidden_layers)

    def to_json_dict(self) -> dict:
        d = asdict(self)
        d["hidden_layers"] = list(self.hidden_layers)
        return d

    @classmethod
    def for_target(cls, target_config, hidden_layers: tuple[int, ...],
                   draft_vocab_size: int = 0) -> EagleConfig:
        """A head the width of `target_config` (a transformers LlamaConfig-like config)."""
        c = target_config.get_text_config(decoder=True)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                   num_heads=c.num_attention_heads,
                   num_kv_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
                   head_dim=head_dim, intermediate_size=c.intermediate_size,
                   hidden_layers=hidden_layers, rope_theta=theta,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-5)),
                   draft_vocab_size=draft_vocab_size)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half form). x [B, h, T, d], pos [B, T] long."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None, :, None].to(torch.float32) * inv  # [B, 1, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attend(
    q: torch.Tensor,  # [B, h, T, d]
    k: torch.Tensor,  # [B, h, S, d] real keys
    v: torch.Tensor,  # [B, h, S, d]
    mask: torch.Tensor,  # [B, T, S] bool: query t may see real slot s
    k_extra: torch.Tensor | None = None,  # [B, h, T, E, d] chain keys of each query's own chain
    v_extra: torch.Tensor | None = None,  # [B, h, T, E, d]
) -> torch.Tensor:  # [B, h, T, d]
    """Softmax attention over real keys (masked) plus each query's own chain keys."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_real = (q @ k.transpose(-1, -2)) * scale  # [B, h, T, S]
    s_real = s_real.masked_fill(~mask[:, None], float("-inf"))
    if k_extra is None:
        w = torch.softmax(s_real, -1).nan_to_num(0.0)
        return w @ v
    s_extra = (q[..., None, :] * k_extra).sum(-1) * scale  # [B, h, T, E]
    w = torch.softmax(torch.cat([s_real, s_extra], -1), -1)
    n = k.shape[2]
    return w[..., :n] @ v + (w[..., n:, None] * v_extra).sum(-2)


class EagleHead(nn.Module):
    """The trainable draft layer plus the frozen target parts attached by `attach`."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        h, n_feat = c.hidden_size, len(c.hidden_layers)
        self.fc_in = nn.Linear(n_feat * h, h, bias=False)  # fuses the target's layers
        self.norm_g = RMSNorm(h, c.rms_norm_eps)  # on g (fused feature or own output)
        self.norm_e = RMSNorm(h, c.rms_norm_eps)  # on the token embedding
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm_attn = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.norm_mlp = RMSNorm(h, c.rms_norm_eps)
        self.gate = nn.Linear(h, c.intermediate_size, bias=False)
        self.up = nn.Linear(h, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        n_vocab = c.draft_vocab_size or c.vocab_size
        self.register_buffer("vocab_ids", torch.arange(n_vocab))  # draft vocabulary (target ids)
        # frozen target parts, set by attach(); not saved with the head
        self.embed: torch.Tensor | None = None  # [V, H] the target's input embedding
        self.norm_weight: torch.Tensor | None = None  # [H] the target's final RMSNorm weight
        self.norm_eps = 1e-5  # the target's final RMSNorm epsilon
        self.lm_weight: torch.Tensor | None = None  # [Vd, H] rows of the target's LM head
        self.full_lm_weight: torch.Tensor | None = None  # [V, H] the target's LM head (shared)

    def attach(self, target) -> None:
        """Share the target's embedding, final norm and LM head rows (frozen, not copied)."""
        base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        emb = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        if emb.shape[1] != self.config.hidden_size or head.shape[0] != self.config.vocab_size:
            raise InvalidValue(
                f"this head was trained for hidden size {self.config.hidden_size} and "
                f"vocabulary {self.config.vocab_size}; the target has {emb.shape[1]} and "
                f"{head.shape[0]}: train a head for this target with `exactspec train-draft`")
        self.embed = emb.detach()
        self.norm_weight = base.norm.weight.detach()
        self.norm_eps = float(getattr(base.norm, "variance_epsilon", getattr(base.norm, "eps", 1e-5)))
        self.full_lm_weight = head.detach()
        self.lm_weight = head.detach()[self.vocab_ids.to(head.device)]

    def set_vocab(self, ids: torch.Tensor) -> None:
        """Replace the draft vocabulary ([Vd] long target ids, sorted); call before attach."""
        self.vocab_ids = ids.long().sort().values.to(self.vocab_ids.device)
        self.config.draft_vocab_size = int(ids.numel())

    # --- pieces ---------------------------------------------------------------------------

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:  # [..., L*H] -> [..., H]
        """g from the target's features: each layer RMS-normalised, then one linear map."""
        h = self.config.hidden_size
        parts = feats.float().unflatten(-1, (-1, h))  # [..., L, H]
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.fc_in(parts.flatten(-2).to(self.fc_in.weight.dtype))

    def qkv(self, g: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor):
        """g [B, T, H], tok [B, T] (token after g's position), pos [B, T] -> x, q, k, v."""
        assert self.embed is not None, "attach(target) first"
        c = self.config
        e = self.embed[tok.clamp(min=0)].to(g.dtype)  # [B, T, H]
        x = self.fc(torch.cat([self.norm_g(g), self.norm_e(e)], -1))  # [B, T, H]
        a = self.norm_attn(x)
        b, t, _ = x.shape
        q = self.q_proj(a).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
        rep = c.num_heads // c.num_kv_heads
        return x, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection + MLP: the predicted feature o [B, T, H]."""
        b, h, t, d = attn.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, h * d))
        m = self.norm_mlp(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))

    def logits(self, o: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        """Draft-vocabulary logits through the target's frozen final norm and LM head."""
        assert self.norm_weight is not None and self.lm_weight is not None, "attach first"
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.norm_weight.float() * x) @ self.lm_weight.float().T

    # --- training-time test ---------------------------------------------------------------

    def unroll(
        self,
        feats: torch.Tensor,  # [B, T, L*H] target features at every position
        tokens: torch.Tensor,  # [B, T] long
        depth: int,
    ) -> list[torch.Tensor]:  # depth tensors [B, T, H]: o at chain start s, depth d
        """Chains from every start s, teacher-forced on `tokens`, `depth` steps deep.

        Depth d (1-based) at start s reads token s+d and predicts token s+d+1, exactly as
        `EagleDrafter` does in decoding (the same attention mask). Entries whose token index
        s+d runs past T are computed on padding and must be masked by the caller.
        """
        b, t, _ = feats.shape
        dev = feats.device
        pos = torch.arange(t, device=dev)[None, :].expand(b, t)  # [B, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None].expand(b, t, t)
        g = self.fuse(feats)  # [B, T, H]
        out, ks, vs = [], [], []
        for d in range(1, depth + 1):
            tok = _shift(tokens, d)  # token s+d at start s, -1 past the end
            x, q, k, v = self.qkv(g, tok, pos + (d - 1))
            if d == 1:
                k_real, v_real = k, v
                a = attend(q, k_real, v_real, causal)
            else:
                ks.append(k)
                vs.append(v)
                a = attend(q, k_real, v_real, causal, torch.stack(ks, 3), torch.stack(vs, 3))
            o = self.finish(x, a)
            out.append(o)
            g = o
        return out


def _shift(tokens: torch.Tensor, d: int) -> torch.Tensor:  # [B, T] -> [B, T], -1 filled
    out = torch.full_like(tokens, -1)
    if d < tokens.shape[1]:
        out[:, : tokens.shape[1] - d] = tokens[:, d:]
    return out


def num_trainable(head: EagleHead) -> int:
    """Parameters saved with the head (the frozen target parts are not)."""
    return sum(p.numel() for p in head.parameters())


_OFF_VOCAB = 1e4  # logit gap below the row minimum for tokens outside the draft vocabulary


def full_logits(head: EagleHead, sub: torch.Tensor) -> torch.Tensor:  # [N, Vd] -> [N, V]
    """Draft-vocabulary logits placed in the full vocabulary; other tokens sit _OFF_VOCAB below
    the row's minimum, so their probability underflows to 0 (finite, as probs_from_logits
    requires)."""
    n = sub.shape[0]
    full = (sub.min(-1, keepdim=True).values - _OFF_VOCAB).expand(n, head.config.vocab_size)
    return full.clone().scatter_(1, head.vocab_ids[None, :].expand(n, -1), sub)
