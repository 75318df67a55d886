"""bf16 on the wire (``PSConfig.wire_dtype="bfloat16"``): a shard's flat fp32 vector in about half the words.

The float words of a shard's vector (params, gradients, float buffers: ``ShardPlan.float_ranges``) travel as
bf16, rounded to nearest even; integer buffers, which are int64 bits in fp32 words (layout.py), travel as
their exact bits (two bf16 slots per word). Two bf16 slots are packed into each fp32 word of the payload, so
every message stays a plain fp32 tensor of the size its header announces (messages.py) and nothing but the
header's ``Flag.BF16`` tells the two encodings apart. The servers decode into fp32 and keep fp32 masters.
"""

from __future__ import annotations

import torch

#: the smallest fp32 magnitude that rounds to Inf in bf16 (halfway between bf16's largest finite value,
#: (2 - 2**-7) * 2**127, and 2**128; round-to-nearest-even rounds it up)
BF16_OVERFLOW = (2.0 - 2.0**-8) * 2.0**127


class Bf16Codec:
    """Encodes and decodes one shard's vector (``numel`` fp32 words, floats at ``float_ranges``)."""

    def __init__(self, numel: int, float_ranges: list[tuple[int, int]]) -> None:
        self.numel = numel
        self.float_ranges = list(float_ranges)
        self.int_ranges: list[tuple[int, int]] = []
        at = 0
        for a, b in self.float_ranges:
            if a > at:
                self.int_ranges.append((at, a))
            at = b
        if at < numel:
            self.int_ranges.append((at, numel))
        n_float = sum(b - a for a, b in self.float_ranges)
        slots = n_float + 2 * (numel - n_float)
        #: fp32 words of an encoded payload (what the header's ``numel`` announces)
        self.words = (slots + 1) // 2

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (fp32, ``numel``) as :attr:`words` fp32 words holding bf16 floats and exact integer bits."""
        if flat.numel() != self.numel:
            raise ValueError(f"a bf16 payload encodes {self.numel} values, got {flat.numel()}")
        out = torch.empty(2 * self.words, dtype=torch.bfloat16)
        at = 0
        for a, b in self.float_ranges:
            out[at : at + b - a].copy_(flat[a:b])  # round to nearest even
            at += b - a
        for a, b in self.int_ranges:
            out[at : at + 2 * (b - a)].copy_(flat[a:b].view(torch.bfloat16))  # bits, not values
            at += 2 * (b - a)
        if at < out.numel():
            out[at:].zero_()
        return out.view(torch.float32)

    def decode(self, words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 vector that :meth:`encode` produced ``words`` from (floats rounded to bf16)."""
        if words.numel() != self.words:
            raise ValueError(f"a bf16 payload of this shard has {self.words} words, got {words.numel()}")
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        halves = words.view(torch.bfloat16)
        at = 0
        for a, b in self.float_ranges:
            out[a:b].copy_(halves[at : at + b - a])
            at += b - a
        for a, b in self.int_ranges:
            out[a:b].view(torch.bfloat16).copy_(halves[at : at + 2 * (b - a)])
            at += 2 * (b - a)
        return out
