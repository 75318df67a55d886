"""Pushes that overlap backward: a shard's data leaves as soon as backward has produced all its gradients.

As DDP's reducer all-reduces a bucket from gradient hooks, a worker packs and sends a shard's data
(gradients, then buffers) from a post-accumulate-grad hook the moment the last gradient of that shard is
accumulated, so the transfer runs while backward computes the rest. Only the data goes early
(``Kind.PUSH_DATA``, no reply): the shard applies nothing until the step's ``PUSH_PULL`` without data brings
the hyperparameters and the push flags. The push stays atomic: the step still checks the whole push for
NaN/Inf before any shard applies any of it, and the has-gradient mask (unused parameters), the sample count
and sync clipping travel with the commit.

What was sent early counts only if nothing changed it since: each sent tensor (a gradient or a buffer) is
fingerprinted by identity, in-place version (``Tensor._version``, which every in-place op autograd sees
bumps) and data pointer. A step that finds a changed fingerprint (clipping, unscaling, a second backward, a
hook that edits or replaces ``.grad``) packs that shard again and sends it with its commit. Not seen: writes
that bypass the version counter (in-place ops on ``.grad.data``, kernels writing a tensor's memory directly).
A shard one of whose gradients never comes (a parameter unused in this step, or frozen since the last one)
is packed and sent at the step, as without overlap; so is one whose early send failed
(the step's own send then fails with the error, where an error of the PS is expected).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from ivyplug.ps.worker.layout import FlatLayout

#: consecutive steps in which every shard sent early changed before the step, after which the client stops
WASTED_STEPS = 2

#: what a fingerprint remembers of one tensor: the object (or None for a missing gradient), its version and
#: where its data lives (``.data = x`` swaps the storage without a version bump)
_Print = list[tuple[torch.Tensor | None, int, int]]


class EarlyPush:
    """Gradient hooks that send each shard's data through ``send(shard, data)`` once backward completes it.

    Armed after every pull (``arm``), so the next backward sends; :meth:`hold` keeps a backward from sending
    (gradient accumulation: only the last micro-batch's backward completes the gradients).
    """

    def __init__(self, layout: FlatLayout, send: Callable[[int, torch.Tensor], None]) -> None:
        self.layout = layout
        # weakly: the hooks live as long as the model, which must not keep a dropped client (and its PS
        # groups) alive; a client that is gone sends nothing
        self._send = weakref.WeakMethod(send) if inspect.ismethod(send) else lambda: send
        plan = layout.plan
        self._params_in: list[list[int]] = []  # per shard: the parameter indices it holds rows of
        self._tensors_in: list[list[tuple[int, str]]] = []  # per shard: (index, kind) of what it packs
        self._shards_of: list[list[int]] = [[] for _ in layout.params]
        for s in range(plan.num_shards):
            seen: dict[int, str] = {}
            for piece in plan.pieces[s]:
                seen.setdefault(piece.index, piece.kind)
            self._tensors_in.append(list(seen.items()))
            self._params_in.append([i for i, kind in seen.items() if kind == "param"])
            for i in self._params_in[-1]:
                self._shards_of[i].append(s)
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._armed = False
        self._holding = 0
        self._remaining: dict[int, int] = {}
        self._fired: set[int] = set()
        self._sent: dict[int, _Print] = {}
        self.stale: set[int] = set()  # after take(): shards sent early whose data changed since
        self._wasted = 0  # consecutive steps whose every early send had to be repeated

    # -- the hooks --------------------------------------------------------------------------------
    def arm(self) -> None:
        """The next backward's hooks send every shard whose gradients it completes."""
        self._sent.clear()
        self._fired.clear()
        params = self.layout.params
        for i, (_, p) in enumerate(params):  # also a parameter unfrozen since the last step (fine-tuning)
            if p.requires_grad and i not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(partial(self._ready, i)))
                self._hooked.add(i)
        self._remaining = {
            s: sum(1 for i in held if i in self._hooked and params[i][1].requires_grad)
            for s, held in enumerate(self._params_in)
        }
        self._armed = True

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Backward inside does not send (its gradients are not the step's yet)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def _ready(self, index: int, param: torch.Tensor) -> None:
        if not self._armed or self._holding or index in self._fired:
            return
        self._fired.add(index)
        for s in self._shards_of[index]:
            left = self._remaining.get(s, 0)
            if left <= 0:  # not counted at arm time (it was frozen then): the step sends this shard
                continue
            self._remaining[s] = left - 1
            if left == 1:
                send = self._send()
                if send is None:
                    return
                data = self.layout.pack(s, 1.0)
                try:
                    send(s, data)
                except Exception:  # a peer is gone, say: the step sends this shard and fails there, naming it
                    continue
                self._sent[s] = self._fingerprint(s)

    # -- the step ---------------------------------------------------------------------------------
    def take(self, valid: bool = True) -> set[int]:
        """Disarm; the shards whose early data is still exactly what the step pushes (not packed again).

        ``valid=False``: none is (the step scales the gradients it pushes: async clipping). :attr:`stale`
        then holds the shards sent early that the step must pack and send again."""
        self._armed = False
        usable = {s for s, fp in self._sent.items() if valid and self._unchanged(s, fp)}
        self.stale = set(self._sent) - usable
        if valid:
            self._wasted = self._wasted + 1 if self._sent and not usable else 0
        self._sent.clear()
        return usable

    @property
    def wasted(self) -> bool:
        """Every early send of the last :data:`WASTED_STEPS` steps had to be repeated (the gradients are always
        changed after backward): the overlap only doubles the traffic."""
        return self._wasted >= WASTED_STEPS

    def _current(self, index: int, kind: str) -> torch.Tensor | None:
        t = self.layout.tensor(index)
        return t.grad if kind == "param" else t

    def _fingerprint(self, s: int) -> _Print:
        out: _Print = []
        for index, kind in self._tensors_in[s]:
            t = self._current(index, kind)
            out.append((t, t._version, t.data_ptr()) if t is not None else (None, 0, 0))
        return out

    def _unchanged(self, s: int, fp: _Print) -> bool:
        for (index, kind), (was, version, ptr) in zip(self._tensors_in[s], fp, strict=True):
            now = self._current(index, kind)
            if now is not was or (now is not None and (now._version != version or now.data_ptr() != ptr)):
                return False
        return True

    def close(self) -> None:
        """Remove the hooks (the client closed, or a wrapper exchanges deltas instead of gradients)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._armed = False
        self._sent.clear()
