"""The flat fp32 layout of a worker's params and buffers per shard, and packing into reused buffers.

A shard's vector holds its pieces (parameter row blocks, whole buffers) in plan order: gradients then
buffers on a push, parameters then buffers on a reply. Float buffers travel by value; integer buffers as
their int64 bits, two fp32 words per element (exact, never touched by float arithmetic).

Tensors on a CUDA device travel through one flat buffer per shard on that device: the pieces are packed
there (device copies), then one device-to-host copy fills the shard's pinned host buffer; a reply takes one
host-to-device copy, then is unpacked on the device. One transfer per shard and step, not one per piece (each
a synchronous copy from pageable memory).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ivyplug.ps.server.shard import piece_shape
from ivyplug.ps.sharding import Piece, ShardPlan
from ivyplug.ps.wire.segments import wire_segments


def buffer_words(b: torch.Tensor) -> torch.Tensor:
    """A buffer as flat fp32 words: float buffers by value, integer ones as their int64 bits (exact)."""
    flat = b.detach().reshape(-1)
    if b.is_floating_point():
        return flat.float()
    return flat.to(torch.int64).view(torch.float32)


class FlatLayout:
    """Where each of a worker's tensors lives in each shard's flat vector; packs and unpacks them."""

    def __init__(
        self,
        plan: ShardPlan,
        params: Sequence[tuple[str, torch.Tensor]],
        buffers: Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        self.plan = plan
        self.params = list(params)
        self.buffers = list(buffers)
        self._push_bufs: dict[int, torch.Tensor] = {}
        self._staged: dict[tuple[int, str], torch.Tensor] = {}  # (shard, "push"/"reply") -> flat on the device
        self.float_ranges = [plan.float_ranges(s) for s in range(plan.num_shards)]
        #: per shard, the cut its payloads travel in over an fp32 wire (wire/segments.py), and each segment's pieces
        self.segments = [wire_segments(plan.pieces[s]) for s in range(plan.num_shards)]
        self.segment_starts = [[seg.start for seg in segs] for segs in self.segments]
        self._segment_pieces = [
            [[p for p in plan.pieces[s] if seg.start <= p.offset < seg.end] for seg in self.segments[s]]
            for s in range(plan.num_shards)
        ]

    def tensor(self, index: int) -> torch.Tensor:
        n = len(self.params)
        return self.params[index][1] if index < n else self.buffers[index - n][1]

    def flat_local(self) -> torch.Tensor:
        """All params then buffers of this process, flat fp32 words (the initial broadcast)."""
        ts = [p.detach().reshape(-1).float().cpu() for _, p in self.params]
        ts += [buffer_words(b).cpu() for _, b in self.buffers]
        return torch.cat(ts) if ts else torch.zeros(0)

    def gather_shard(self, full: torch.Tensor, shard: int, out: torch.Tensor) -> None:
        """Copy ``shard``'s pieces out of a :meth:`flat_local` vector into ``out``."""
        starts = [0]
        for s in self.plan.specs:
            starts.append(starts[-1] + s.words)
        for p in self.plan.pieces[shard]:
            spec = self.plan.specs[p.index]
            row = spec.numel // (spec.shape[0] if spec.shape else 1) if spec.shape else 1
            a = starts[p.index] + p.row_start * row
            out[p.offset : p.offset + p.numel].copy_(full[a : a + p.numel])

    def shard_values(self, full: torch.Tensor, shard: int) -> torch.Tensor:
        out = torch.empty(self.plan.shard_numel(shard), dtype=torch.float32)
        self.gather_shard(full, shard, out)
        return out

    def staging_device(self, shard: int) -> torch.device | None:
        """The CUDA device ``shard`` is packed and unpacked on through one flat buffer (where all its tensors
        live on that one device: one transfer per shard, see the module docstring), else None (piece by piece)."""
        devices = {self.tensor(p.index).device for p in self.plan.pieces[shard]}
        if len(devices) != 1:
            return None
        device = devices.pop()
        return device if device.type == "cuda" else None

    def host_buffer(self, numel: int, shard: int) -> torch.Tensor:
        """An fp32 host buffer for ``shard``'s payloads: pinned where the shard is staged on CUDA (its copies
        to and from the device then run at full speed, and without an extra staging copy by the driver)."""
        device = self.staging_device(shard)
        return torch.empty(numel, dtype=torch.float32, pin_memory=device is not None and device.type == "cuda")

    def use_push_buffer(self, shard: int, buf: torch.Tensor) -> None:
        """Pack ``shard``'s pushes into ``buf`` from now on (a shared-memory region: nothing is copied again)."""
        numel = self.plan.shard_numel(shard)
        if buf.numel() != numel or buf.dtype != torch.float32 or buf.device.type != "cpu":
            raise ValueError(
                f"shard {shard}: a push buffer must be {numel} fp32 words on the CPU, got {buf.numel()} "
                f"{buf.dtype} on {buf.device}"
            )
        self._push_bufs[shard] = buf

    def _push_buf(self, shard: int) -> torch.Tensor:
        out = self._push_bufs.get(shard)
        if out is None:
            out = self._push_bufs[shard] = self.host_buffer(self.plan.shard_numel(shard), shard)
        return out

    def _staged_buf(self, shard: int, what: str, device: torch.device) -> torch.Tensor:
        buf = self._staged.get((shard, what))
        if buf is None or buf.device != device:
            buf = torch.empty(self.plan.shard_numel(shard), dtype=torch.float32, device=device)
            self._staged[(shard, what)] = buf
        return buf

    def _pack_pieces(self, out: torch.Tensor, pieces: Sequence[Piece], clip: float) -> None:
        for p in pieces:
            dst = out[p.offset : p.offset + p.numel]
            t = self.tensor(p.index)
            if not p.is_float:
                dst.copy_(buffer_words(t))
                continue
            if p.kind == "param":
                g = t.grad
                if g is None:
                    dst.zero_()
                    continue
                src = g.detach()
            else:
                src = t.detach()
            if src.dim() > 0 and (p.row_start, p.row_end) != (0, src.shape[0]):
                src = src[p.row_start : p.row_end]
            dst.copy_(src.reshape(-1))
            if p.kind == "param" and clip != 1.0:
                dst.mul_(clip)

    def pack(self, shard: int, clip: float) -> torch.Tensor:
        """This worker's gradients (zeros where None, times ``clip``) then buffers of ``shard``.

        Into a buffer allocated once per shard: a fresh multi-MB tensor per step costs page faults on first
        touch (glibc serves large blocks with mmap), about as much as the copy. Reuse is safe: a step waits
        for its sends and unpacks every reply before the next step packs into the same buffer.
        """
        out = self._push_buf(shard)
        device = self.staging_device(shard)
        if device is None:
            self._pack_pieces(out, self.plan.pieces[shard], clip)
            return out
        staged = self._staged_buf(shard, "push", device)
        self._pack_pieces(staged, self.plan.pieces[shard], clip)
        out.copy_(staged, non_blocking=True)  # the one device-to-host copy of the shard
        _wait_for(device)  # the host buffer is complete before it is checked and sent
        return out

    def payload(self, shard: int, clip: float, split: bool) -> torch.Tensor | list[torch.Tensor]:
        """What a push sends for ``shard``: :meth:`pack`'s buffer, or (``split``) one tensor per segment of
        its cut, each large gradient as itself (no copy) where it can travel so (:meth:`_in_place`)."""
        if not split or self.staging_device(shard) is not None:  # staged: one copy off the device (the endpoint cuts)
            return self.pack(shard, clip)
        out = self._push_buf(shard)
        pieces = self.plan.pieces[shard]
        parts = []
        for seg, inside in zip(self.segments[shard], self._segment_pieces[shard], strict=True):
            view = self._in_place(pieces[seg.piece], grad=True) if seg.piece is not None and clip == 1.0 else None
            if view is None:
                self._pack_pieces(out, inside, clip)
                view = out[seg.start : seg.end]
            parts.append(view)
        return parts

    def reply_targets(self, shard: int, only: Collection[int] | None = None) -> list[torch.Tensor | None]:
        """Per segment of ``shard``'s cut, the parameter (part) its reply part can be received into in place,
        else None (received into the reply buffer, then unpacked). ``only``: see :meth:`unpack`."""
        pieces = self.plan.pieces[shard]
        return [
            self._in_place(pieces[seg.piece], grad=False)
            if seg.piece is not None and self._writes(pieces[seg.piece].index, only)
            else None
            for seg in self.segments[shard]
        ]

    def _writes(self, index: int, only: Collection[int] | None) -> bool:
        """Whether a reply writes tensor ``index``: every buffer (in a step of ``only``, where its value changed), and
        the parameters in ``only`` (None: all)."""
        return only is None or index >= len(self.params) or index in only

    def _in_place(self, piece: Piece, grad: bool) -> torch.Tensor | None:
        """The flat view of ``piece`` in its parameter's ``.grad`` (``grad``) or in the parameter itself, when
        that memory can go on the wire as it is: fp32, on the CPU, contiguous. Else None (it is copied)."""
        owner = self.tensor(piece.index)
        t = owner.grad if grad else owner
        if t is None:
            return None
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.is_sparse or not t.is_contiguous():
            return None
        flat = t.detach().view(-1)
        row = flat.numel() // t.shape[0] if t.dim() > 0 else 1
        view = flat[piece.row_start * row : piece.row_end * row]
        return view if view.numel() == piece.numel else None

    def packed(self, shard: int) -> torch.Tensor:
        """The buffer :meth:`pack` last filled for ``shard``."""
        return self._push_bufs[shard]

    def unpack(
        self, shard: int, flat: torch.Tensor, placed: Sequence[int] = (), only: Collection[int] | None = None
    ) -> None:
        """Write a reply (``shard``'s params then buffers) into this worker's tensors, but for the pieces
        of the segments at positions ``placed`` of its cut (received in place).

        ``only``: the indices of the parameters to write (the step of one of several optimizers), None: all. The
        others are left untouched, their autograd versions too: a graph built before this step may still hold
        them (a GAN's generator output, whose backward follows the discriminator's step)."""
        skip = {self.segments[shard][i].piece for i in placed}
        device = self.staging_device(shard)
        if device is not None and not skip:
            staged = self._staged_buf(shard, "reply", device)
            staged.copy_(flat, non_blocking=True)  # the one host-to-device copy of the shard
            self._unpack_pieces(shard, staged, skip, only)
            _wait_for(device)  # done reading ``flat``: the next reply may be received into it
            return
        self._unpack_pieces(shard, flat, skip, only)

    def _unpack_pieces(
        self, shard: int, flat: torch.Tensor, skip: set[int | None], only: Collection[int] | None
    ) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.plan.pieces[shard]):
                t = self.tensor(p.index)
                if i in skip:  # written by the receive itself: autograd must still see the change
                    torch.autograd.graph.increment_version(t)
                    continue
                if not self._writes(p.index, only):
                    continue
                spec = self.plan.specs[p.index]
                if not p.is_float:  # int64 bits, exact (cloned: a view needs 8-byte alignment)
                    dst, src = t, flat[p.offset : p.offset + p.numel].clone().view(torch.int64).view(t.shape)
                else:
                    src = flat[p.offset : p.offset + p.numel].view(piece_shape(spec.shape, p))
                    rows = t.dim() > 0 and (p.row_start, p.row_end) != (0, t.shape[0])
                    dst = t[p.row_start : p.row_end] if rows else t
                    src = src.view(t.shape) if t.dim() == 0 else src
                if only is not None and p.index >= len(self.params) and torch.equal(dst, src.to(dst.dtype)):
                    continue  # a buffer the step did not change (a mask) keeps its autograd version too
                dst.copy_(src)

    def first_nonfinite(self) -> str:
        """Names the first gradient or float buffer holding a NaN/Inf (for the error and the warning)."""
        for n, p in self.params:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"the gradient of {n!r}"
        for n, b in self.buffers:
            if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                return f"buffer {n!r}"
        return "a pushed tensor"


def _wait_for(device: torch.device) -> None:
    """Block until the copies queued on ``device``'s current stream are done (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
