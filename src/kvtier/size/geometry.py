"""KV geometry of a model and the bytes its KV cache costs per token and per sequence.

Formula (how-to § "The sizing math", operator's guide § "Sizing math")::

    kv_bytes_per_token = 2 (K and V) × layers × kv_heads × head_dim × dtype_bytes

extended to the layer kinds vLLM actually holds:

- GQA/MQA/MHA layers: ``2 × kv_heads × head_dim`` elements per token per layer.  Each
  tensor-parallel rank holds ``max(1, kv_heads // tp)`` heads (vLLM ``ModelConfig.get_num_kv_heads``),
  so when TP exceeds the KV-head count the heads are replicated and the TP-wide total grows.
- MLA layers (DeepSeek-V2/V3 style): one compressed latent of ``kv_lora_rank`` plus the decoupled
  rope part ``qk_rope_head_dim`` per token per layer -- one tensor, not a K and a V.  The latent has
  no head dimension to split, so every rank holds all of it.
- Sliding-window layers hold only the last ``sliding_window`` tokens of a sequence.
- Mamba / linear-attention layers hold a constant state per sequence, independent of length.

All byte counts are plain ``int`` bytes.  ``per_rank`` figures are what one tensor-parallel rank
holds; ``total`` figures are ``per_rank × tp`` -- what all ranks hold together, which is the
convention of vLLM's ``--kv-offloading-size`` (total across TP, operator's guide § "Sizing math").
Block rounding (vLLM allocates whole blocks of ``block_size`` tokens) is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.errors import UserError


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: per token per layer one vector of ``kv_lora_rank + rope_dim``."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def elems_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class StateSpec:
    """Constant per-sequence state of one Mamba / linear-attention layer.

    Attributes:
        kind: ``"mamba1"``, ``"mamba2"`` or ``"gated_deltanet"`` (for reports).
        conv_elems: elements of the convolution state, whole model width (all heads).
        ssm_elems: elements of the SSM / recurrent state, whole model width.
        conv_dtype_bytes, ssm_dtype_bytes: bytes per element of each (model dtype unless the
            config pins ``mamba_ssm_dtype``).
        heads: heads the state splits over across tensor-parallel ranks.
    """

    kind: str
    conv_elems: int
    ssm_elems: int
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    heads: int

    @property
    def bytes(self) -> int:
        return self.conv_elems * self.conv_dtype_bytes + self.ssm_elems * self.ssm_dtype_bytes

    def bytes_per_rank(self, tp: int) -> int:
        """State bytes one rank holds: split over ``min(tp, heads)`` ranks, replicated beyond."""
        shards = max(1, min(tp, self.heads))
        return -(-self.bytes // shards)


@dataclass(frozen=True)
class GroupSize:
    """What one kind of layer holds, as vLLM groups them (one KV cache group per kind with the
    hybrid memory allocator; kvtier stores each group apart, see ``docs/vllm.md`` § Hybrid models).

    Attributes:
        kind: ``"full"`` (every token), ``"sliding"`` (the last ``held_tokens`` tokens) or
            ``"state"`` (a constant per-sequence state, no per-token bytes).
        num_layers: layers of this kind.
        bytes_per_token: bytes per token of all these layers together, all TP ranks (0 for state).
        held_tokens: sliding window in tokens; None for full attention (all) and state.
        state_bytes_per_sequence: state bytes per sequence, all TP ranks (0 unless state).
    """

    kind: str
    num_layers: int
    bytes_per_token: int
    held_tokens: int | None = None
    state_bytes_per_sequence: int = 0

    def bytes_per_sequence(self, context_tokens: int) -> int:
        """Bytes this group holds for one sequence of ``context_tokens`` tokens (all TP ranks)."""
        held = context_tokens if self.held_tokens is None else min(context_tokens, self.held_tokens)
        return self.bytes_per_token * held + self.state_bytes_per_sequence


@dataclass(frozen=True)
class KVGeometry:
    """What a model's KV cache is made of.

    Attributes:
        name: model name or path, for reports.
        num_full_layers: attention layers that keep every token.
        num_swa_layers: sliding-window attention layers (keep ``sliding_window`` tokens).
        sliding_window: window in tokens, or None when there are no sliding-window layers.
        num_attention_heads: query heads (TP must divide it), or None when unknown.
        num_kv_heads: KV heads of a GQA/MHA layer (ignored for MLA).
        head_dim: elements per K (and per V) head.
        mla: set for MLA models.
        num_state_layers: Mamba / linear-attention layers; state: their per-layer state.
        source: where the numbers came from (a config.json path or a published URL).
    """

    name: str
    num_full_layers: int
    num_swa_layers: int
    sliding_window: int | None
    num_attention_heads: int | None
    num_kv_heads: int
    head_dim: int
    mla: MLASpec | None = None
    num_state_layers: int = 0
    state: StateSpec | None = None
    source: str = ""

    @property
    def num_attention_layers(self) -> int:
        return self.num_full_layers + self.num_swa_layers

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank holds: ``max(1, kv_heads // tp)`` (vLLM ``get_num_kv_heads``); 1 for MLA."""
        if self.mla is not None:
            return 1
        return max(1, self.num_kv_heads // tp)

    def check_tp(self, tp: int) -> None:
        """Raise UserError when vLLM would refuse this TP size for this model.

        vLLM requires TP to divide the attention heads, and the KV heads to divide evenly
        (``kv_heads % tp == 0`` or ``tp % kv_heads == 0``, heads then replicated).
        """
        if tp < 1:
            raise UserError(f"--tp must be at least 1, got {tp}.")
        if self.num_attention_heads is not None and self.num_attention_heads % tp:
            raise UserError(
                f"TP {tp} does not divide the {self.num_attention_heads} attention heads of {self.name}; "
                "vLLM refuses this, pick a TP size that divides them."
            )
        kvh = self.num_kv_heads
        if self.mla is None and kvh % tp and tp % kvh:
            raise UserError(
                f"TP {tp} and the {kvh} KV heads of {self.name} do not divide each other; "
                "vLLM refuses this, pick a TP size that divides or is a multiple of the KV heads."
            )

    def layer_token_bytes_per_rank(self, tp: int, dtype_bytes: int) -> int:
        """Bytes one attention layer holds per token on one rank."""
        if self.mla is not None:
            return self.mla.elems_per_token * dtype_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes

    def kv_bytes_per_token_per_rank(self, tp: int, dtype_bytes: int) -> int:
        """Bytes per token of every attention layer (full and sliding) on one rank.

        This is the rate while a token is inside every window -- the classic
        ``2 × layers × kv_heads × head_dim × dtype_bytes`` for a plain model.
        """
        return self.num_attention_layers * self.layer_token_bytes_per_rank(tp, dtype_bytes)

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """Bytes per token across all TP ranks (per-rank × tp; grows once TP > KV heads)."""
        return self.kv_bytes_per_token_per_rank(tp, dtype_bytes) * tp

    def bytes_per_sequence_per_rank(self, context_tokens: int, tp: int, dtype_bytes: int) -> int:
        """Bytes one rank holds for one sequence of ``context_tokens`` tokens.

        full layers × context + sliding layers × min(context, window) + constant state.
        """
        per_layer = self.layer_token_bytes_per_rank(tp, dtype_bytes)
        held_swa = min(context_tokens, self.sliding_window or 0)
        state = self.num_state_layers * self.state.bytes_per_rank(tp) if self.state else 0
        return per_layer * (self.num_full_layers * context_tokens + self.num_swa_layers * held_swa) + state

    def bytes_per_sequence(self, context_tokens: int, tp: int, dtype_bytes: int) -> int:
        """Bytes all TP ranks hold together for one sequence of ``context_tokens`` tokens."""
        return self.bytes_per_sequence_per_rank(context_tokens, tp, dtype_bytes) * tp

    def state_bytes_per_sequence(self, tp: int) -> int:
        """Constant Mamba / linear-attention state per sequence across all ranks (0 if none)."""
        if self.state is None:
            return 0
        return self.num_state_layers * self.state.bytes_per_rank(tp) * tp

    def groups(self, tp: int, dtype_bytes: int) -> tuple[GroupSize, ...]:
        """Bytes per token per layer kind (all TP ranks): full attention, sliding window, state.

        Their ``bytes_per_sequence`` add up to :meth:`bytes_per_sequence`.
        """
        per_layer = self.layer_token_bytes_per_rank(tp, dtype_bytes) * tp
        out = []
        if self.num_full_layers:
            out.append(GroupSize("full", self.num_full_layers, per_layer * self.num_full_layers))
        if self.num_swa_layers:
            out.append(GroupSize("sliding", self.num_swa_layers, per_layer * self.num_swa_layers,
                                 held_tokens=self.sliding_window or 0))
        if self.num_state_layers and self.state:
            out.append(GroupSize("state", self.num_state_layers, 0, state_bytes_per_sequence=self.state_bytes_per_sequence(tp)))
        return tuple(out)

    @property
    def kind(self) -> str:
        """Short description: ``"GQA"``, ``"MLA"``, ``"GQA + sliding window"``, ``"hybrid ..."``."""
        parts = ["MLA" if self.mla else ("MHA" if self.num_kv_heads == self.num_attention_heads else "GQA")]
        if self.num_swa_layers:
            parts.append("sliding window")
        if self.num_state_layers and self.state:
            parts.append(f"{self.state.kind} state")
        return " + ".join(parts)
