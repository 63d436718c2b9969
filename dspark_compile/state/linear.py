"""State of linear layers (Gated DeltaNet, Mamba-2, short conv): slot pools and replay rings.

Per linear layer ``i``::

    conv_states[i]       [max_requests, conv_dim, W-1]   model dtype   last W-1 committed inputs
                         (the conv's input dtype where its spec names one)
    recurrent_states[i]  [max_requests, Hv, K, V]        float32       committed recurrent state
                         (Mamba-2: [max_requests, H, N, P]; a short-conv layer's is empty)
    rings["conv_ring_i"], and rings["gdn_ring_{k,v,g,beta}_i"] (GDN) or
    rings["ssd_ring_{x,b,da}_i"] (Mamba-2)              [max_step_tokens, ...]

The forward ops (``dspark::causal_conv1d``, ``dspark::gated_delta_rule``, ``dspark::ssd``) only
*read* the pools and save each packed row's inputs in the rings; :meth:`LinearPools.
replay_accepted` replays each request's accepted prefix onto its slot. A new request starts from
zeros (:meth:`release`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..specs import LinearSpec, RingSpec

__all__ = ["LinearPools"]


@dataclass
class LinearPools:
    """Slot pools and replay rings of every linear-attention layer (see module docstring)."""

    conv_states: list[torch.Tensor]
    """Per linear layer: ``[max_requests, conv_dim, W-1]``."""
    recurrent_states: list[torch.Tensor]
    """Per linear layer: ``[max_requests, Hv, K, V]`` float32."""
    rings: dict[str, torch.Tensor]
    """Replay rings by graph input name, ``[max_step_tokens, ...]`` each."""
    max_step_tokens: int
    """Rows of every ring: the most packed tokens one forward may run."""

    @classmethod
    def allocate(cls, specs: list[LinearSpec], rings: list[RingSpec], max_requests: int,
                 max_step_tokens: int, dtype: torch.dtype, device) -> "LinearPools":
        conv = [torch.zeros(max_requests, s.conv_dim, max(s.conv_width - 1, 0),
                            dtype=s.conv_dtype or dtype, device=device)
                for s in specs]  # a scan alone: [R, 0, 0]
        rec = [torch.zeros(max_requests, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                           dtype=torch.float32, device=device) for s in specs]
        buffers = {r.name: torch.zeros(max_step_tokens, *r.row_shape, dtype=r.dtype,
                                       device=device) for r in rings}
        return cls(conv, rec, buffers, max_step_tokens)

    def check_rows(self, num_tokens: int) -> None:
        """Refuse a forward whose rows do not fit the replay rings."""
        if num_tokens > self.max_step_tokens:
            raise ValueError(
                f"input_ids has {num_tokens} rows but this state's replay rings hold "
                f"max_step_tokens={self.max_step_tokens}; a model with linear-attention layers "
                "saves one ring row per token. Split the forward (e.g. a long prefill) into "
                "steps of at most that many tokens, or build the verifier with a larger "
                "DSparkConfig.max_step_tokens")

    def replay_accepted(self, ops: dict, query_start_loc: torch.Tensor, slots: torch.Tensor,
               accept_lens: torch.Tensor) -> None:
        """Replay each request's first ``accept_lens[i]`` ring rows onto its slot (in place).

        ``ops`` maps ``"conv"`` / ``"gdn"`` / ``"ssd"`` to the commit op of the verifier's
        lowering; the layout tensors are on the pools' device. A layer's rings say its kind.
        """
        for i, (conv, rec) in enumerate(zip(self.conv_states, self.recurrent_states)):
            if f"conv_ring_{i}" in self.rings:  # not for a scan with no conv window
                ops["conv"](conv, self.rings[f"conv_ring_{i}"], query_start_loc, slots,
                            accept_lens)
            for kind, names in (("gdn", ("k", "v", "g", "beta")), ("ssd", ("x", "b", "da"))):
                if f"{kind}_ring_{names[0]}_{i}" in self.rings:
                    rings = [self.rings[f"{kind}_ring_{r}_{i}"] for r in names]
                    ops[kind](rec, *rings, query_start_loc, slots, accept_lens)

    def release(self, slots: torch.Tensor) -> None:
        """Zero the state of ``slots``: a new request in them starts from nothing."""
        for pool in (*self.conv_states, *self.recurrent_states):
            pool[slots.to(pool.device)] = 0
