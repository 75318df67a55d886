"""bf16 on the wire (``PSConfig.wire_dtype="bfloat16"``): a shard's flat fp32 vector in about half the words.

The float words of a shard's vector (params, gradients, float buffers: ``ShardPlan.float_ranges``) travel as
bf16, rounded to nearest even; integer buffers, which are int64 bits in fp32 words (worker/layout.py), travel as
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


#: ``PSConfig.wire_dtype`` -> bits of a block-quantized push
BLOCK_BITS = {"int8": 8, "int4": 4}

#: values per block, each block with its own fp32 scale (1 scale word per 128 values: 3% over int8's bytes)
BLOCK = 128


class BlockCodec:
    """Block-wise int8/int4 pushes with error feedback (``PSConfig.wire_dtype="int8"`` / ``"int4"``).

    The first ``quantized`` words of a shard's vector (its gradients or local-update deltas, all floats) travel
    as ``bits``-bit integers, one fp32 scale per :data:`BLOCK` values (``scale = max|x| / qmax``, ``qmax`` 127
    or 7, rounded to nearest); the rest (buffers, integer buffers as exact bits) travels as plain fp32 words.
    With ``feedback=True`` what rounding leaves out of a push is carried into the next one: the codec keeps
    ``e``, encodes ``x + e`` and keeps ``e <- x + e - decoded``, so the decoded pushes sum to the true pushes
    less the last ``e`` (at most half a step, ``scale / 2``, per value): nothing is lost over time. A worker
    holds one codec per shard; the servers only decode (:meth:`decode`).
    """

    def __init__(self, numel: int, quantized: int, bits: int, block: int = BLOCK) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        if not 0 <= quantized <= numel:
            raise ValueError(f"quantized must be in [0, numel={numel}], got {quantized}")
        if block < 2 or block % 2:
            raise ValueError(f"block must be an even number >= 2, got {block}")
        self.numel, self.quantized, self.bits, self.block = numel, quantized, bits, block
        self.qmax = 127 if bits == 8 else 7
        self.blocks = -(-quantized // block)
        self._padded = self.blocks * block
        self._qbytes = self._padded if bits == 8 else self._padded // 2
        #: fp32 words of an encoded payload: the scales, the packed integers, the plain tail
        self.words = self.blocks + -(-self._qbytes // 4) + (numel - quantized)
        self.residual: torch.Tensor | None = None  # e, carried into the next push (feedback only)

    def reset(self) -> None:
        """Forget the carried error (after a push that was dropped whole: it applied nothing)."""
        self.residual = None

    def encode(self, flat: torch.Tensor, feedback: bool = True) -> torch.Tensor:
        """``flat`` (fp32, ``numel``) as :attr:`words` fp32 words; ``feedback``: add and update the carried error."""
        if flat.numel() != self.numel:
            raise ValueError(f"a {self.bits}-bit payload encodes {self.numel} values, got {flat.numel()}")
        n, out = self.quantized, torch.empty(self.words, dtype=torch.float32)
        x = torch.zeros(self._padded, dtype=torch.float32)
        x[:n].copy_(flat[:n])
        if feedback:
            if self.residual is None:
                self.residual = torch.zeros(n, dtype=torch.float32)
            x[:n].add_(self.residual)
        blocks = x.view(self.blocks, self.block)
        scales = blocks.abs().amax(dim=1).div_(self.qmax)
        q = torch.round(blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(1)).clamp_(-self.qmax, self.qmax)
        if feedback:
            assert self.residual is not None
            self.residual.copy_(x[:n]).sub_((q * scales.unsqueeze(1)).view(-1)[:n])
        out[: self.blocks].copy_(scales)
        packed = out[self.blocks : self.words - (self.numel - n)].view(torch.uint8)
        ints = q.view(-1).to(torch.int8)
        if self.bits == 8:
            packed[: self._qbytes].copy_(ints.view(torch.uint8))
        else:
            nibbles = (ints + 8).to(torch.uint8).view(-1, 2)  # 1..15, two per byte: low, then high
            packed[: self._qbytes].copy_(nibbles[:, 0] | (nibbles[:, 1] << 4))
        packed[self._qbytes :].zero_()
        out[self.words - (self.numel - n) :].copy_(flat[n:])
        return out

    def decode(self, words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 vector :meth:`encode` produced ``words`` from (the quantized part as scale * integer)."""
        if words.numel() != self.words:
            raise ValueError(f"a {self.bits}-bit payload of this shard has {self.words} words, got {words.numel()}")
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        n, tail = self.quantized, self.numel - self.quantized
        scales = words[: self.blocks]
        packed = words[self.blocks : self.words - tail].view(torch.uint8)[: self._qbytes]
        if self.bits == 8:
            q = packed.view(torch.int8).float()
        else:
            q = torch.stack([(packed & 0x0F), (packed >> 4)], dim=1).view(-1).float().sub_(8.0)
        deq = q.view(self.blocks, self.block).mul_(scales.unsqueeze(1))
        out[:n].copy_(deq.view(-1)[:n])
        out[n:].copy_(words[self.words - tail :])
        return out


#: bits of a pull's difference (:class:`PulledCopy`), with int8 and int4 pushes alike: a push's rounding is
#: averaged over the workers and damped by the outer step, but a pull's is what a worker trains from; in 3-seed
#: runs across hosts int4 pulls ended 0.65 points below DDP where int8 pulls ended at it
PULL_BITS = 8


class PulledCopy:
    """The copy of a shard's parameters one worker holds, kept alike at both ends, so that pulls can travel as
    int8 block-quantized differences from it (``PSConfig.wire_dtype="int8"`` / ``"int4"``; :data:`PULL_BITS`).

    A worker's first pull (``pull_initial``; after a restore, the first step's) travels in bf16, and both ends keep
    its decoded parameters as the copy ``c`` (``sync()``'s and a restore's own pull are exact fp32, and leave ``c``
    alone at both ends; ``sync(exact=False)``'s is a step's). Every later pull travels as ``q = Q(x − c)``
    (:class:`BlockCodec`, no carried residual; the buffers, its tail, travel as plain fp32) and both ends set
    ``c ← c + D(q)``: the server in :meth:`encode`, the worker in :meth:`decode`, with the same decoded values, so
    the two copies stay equal bit for bit. What rounding leaves out of one difference stays in ``x − c`` and
    travels with the next, so the worker's parameters are never further from the server's than half a step of the
    last difference (``scale / 2`` per value, the same bound as a push's error feedback) and nothing accumulates.
    """

    def __init__(self, block: BlockCodec, bf16: Bf16Codec) -> None:
        if block.numel != bf16.numel:
            raise ValueError(f"the codecs of a pulled copy encode one shard: {block.numel} != {bf16.numel} values")
        self.block, self.bf16 = block, bf16
        self.values: torch.Tensor | None = None  # c: the parameters both ends hold; None until a bf16 pull

    @property
    def held(self) -> bool:
        """Whether a copy is held (a pull may then travel as a difference)."""
        return self.values is not None

    def forget(self) -> None:
        """Drop the copy: the next pull travels whole, in bf16 (after a restore, which moves every value)."""
        self.values = None

    def encode_whole(self, flat: torch.Tensor) -> torch.Tensor:
        """Server: ``flat`` in bf16 words (:class:`Bf16Codec`), keeping what the worker decodes as the copy."""
        words = self.bf16.encode(flat)
        self.values = self.bf16.decode(words)[: self.block.quantized]  # a fresh tensor: a view of it is the copy
        return words

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """Server: ``flat`` as the quantized difference from the copy (:attr:`BlockCodec.words` words); the copy
        moves by what the worker will decode."""
        if self.values is None:
            raise ValueError("no pulled copy is held: the first pull travels whole (encode_whole)")
        n = self.block.quantized
        # a scratch per pull, not one per copy: a serve holds a copy per worker and shard
        diff = torch.empty_like(flat)
        torch.sub(flat[:n], self.values, out=diff[:n])
        diff[n:].copy_(flat[n:])
        words = self.block.encode(diff, feedback=False)
        self.values.add_(self.block.decode(words, diff)[:n])  # what the worker decodes; diff is spent
        return words

    def decode_whole(self, words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Worker: a bf16 pull, kept as the copy."""
        out = self.bf16.decode(words, out)
        self.values = out[: self.block.quantized].clone()
        return out

    def decode(self, words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Worker: a difference pull; the copy moves by it and ``out`` is the copy plus the fp32 tail."""
        if self.values is None:
            raise ValueError("no pulled copy is held: a difference cannot be applied")
        n = self.block.quantized
        out = self.block.decode(words, out)
        self.values.add_(out[:n])
        out[:n].copy_(self.values)
        return out
