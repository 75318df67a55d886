"""Wire format: a fixed-size, versioned int64 header, then the payload from that sender.

gloo aborts the process (SIGABRT, uncatchable) when a receive-from-any-source gets a message of another
size, so every message a server receives from "anyone" is exactly ``HEADER_LEN`` int64 values. The header
names the sender and the sizes of what follows; the server then receives the payloads *from that sender*
with their own tags. Payloads are plain tensors (fp32 data, fp64 hyperparameters); nothing is unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

import torch

MAGIC = 0x1B5F_5053  # "ivy PS"
WIRE_VERSION = 6  # 2: payloads may travel cut into segments (Flag.SPLIT); 3: or in shared memory (Flag.SHM);
#                  4: pushes may travel block-quantized (Flag.INT8, Flag.INT4), pulls as differences (Flag.DIFF);
#                  5: a push's hyperparameters carry its number; shards exchange split LAMB tensors' sums;
#                  6: and sync mode's clip value (push.hyper_prefix)
HEADER_LEN = 16

# tags on the PS point-to-point group
TAG_REQUEST = 11  # headers sent to a server (received from any source)
TAG_REQUEST_DATA = 12  # fp32 payload of a request (received from the header's sender)
TAG_REQUEST_HYPER = 13  # fp64 payload of a request
TAG_REPLY = 21  # reply headers (received from the server a worker asked)
TAG_REPLY_DATA = 22  # fp32 payload of a reply
TAG_REPLY_TEXT = 23  # UTF-8 text of an error reply (header arg3 = its length in bytes), after the payload
# A PUSH_PULL/PULL reply's header: arg0 = staleness, arg1 = version, arg2 = clock, arg3 = the float64 bits of
# the last sync step's combined-gradient squared norm on that shard (float_arg; NaN outside sync).

#: longest error text a server sends back (the rest is cut)
MAX_ERROR_TEXT = 4000


class Kind:
    """Message kinds (header field ``kind``)."""

    PUSH_PULL = 1  # gradients (+ buffers, hyperparameters) in; fresh params (+ buffers) out. Without data: the
    #                data is the sender's last PUSH_DATA to that shard
    PULL = 2  # fresh params (+ buffers) out
    IDLE = 3  # the worker leaves the SSP clock set until its next push (epoch end, sync)
    BYE = 4  # the worker (or peer server) is done: the server loop ends after all peers said it
    NEXT_BATCH = 5  # next batch index of the epoch (arg0 = epoch, arg1 = batches finished, arg2 = a BatchAsk)
    STOP = 6  # raise the stop flag
    NORM = 7  # server to server: squared norm of a combined sync step (hyper payload = [sq_norm])
    STATE_SIZE = 8  # dedicated server: serialise the shard's state, reply arg0 = its length in bytes
    STATE_FETCH = 9  # dedicated server: reply with that state (bytes padded to fp32 words)
    LOAD = 10  # dedicated server: payload = a state (bytes in fp32 words, arg0 = length); reply when loaded
    JOIN = 11  # ivyplug serve: payload = job description and initial values (typed encoding, arg0 = length),
    #            arg1 = the slot asked for (-1: any), arg2 = the job's worker count; reply arg0 = the slot given,
    #            arg1 = 1 if the job was created from this worker's values, arg2 = the servers' worker slots
    EPOCH = 12  # ivyplug serve: refill the batch queue (arg0 = epoch, arg1 = batches, arg2 = reserved); reply when done
    GATHER = 13  # ivyplug serve: a collective among the live workers (payload = this worker's bytes in words,
    #              arg0 = their length, arg1 = the collective's number); reply arg0 = the result's length
    GATHER_FETCH = 14  # ivyplug serve: the result of collective arg1 (reply payload, arg0 = its length)
    PUSH_DATA = 15  # the data of a push (gradients + buffers) ahead of its PUSH_PULL, which then carries no
    #                 data: sent from backward's gradient hooks (worker/early_push.py); no reply, nothing applied yet
    REPLY = 16
    TRUST_SUMS = 18  # server to server: an update's sums of squares of the pieces of split LAMB tensors a shard holds
    #                  (hyper payload = [tensor, sum x², sum u², ...]; arg0/arg2 = the update's key: push number and
    #                  worker, or sync version and -1; server/split_trust.py)
    SHM_ATTACH = 17  # map the sender's shared-memory region for this shard (shared_region.py): payload = its
    #                  path (bytes in fp32 words, arg0 = length), arg1/arg2 = its nonce; reply arg0 = 1 if mapped


class BatchAsk:
    """What a NEXT_BATCH asks for (header ``arg2``); the reply's ``arg0`` is the index, -1 (none) or -2 (wait)."""

    NOW = 0  # an index, or -2 where the answer would have to wait
    END = 1  # nothing: the worker trained every batch it got this epoch
    WAIT = 2  # an index, waiting for it if need be
    STOP = 3  # nothing: the worker reached the fit's step limit, so the epoch hands out no more batches


class Status:
    OK = 0
    ERROR = 1


class Flag:
    STOP = 1
    BF16 = 2  # PUSH_PULL/PUSH_DATA/PULL: the request's payload and its reply's are bf16 pairs in fp32 words
    SPLIT = 4  # PUSH_PULL/PULL: the request's fp32 payload and its reply's travel as the shard's segments
    #            (segments.py), one message each; an error reply to such a request carries no payload
    SHM = 8  # PUSH_PULL/PUSH_DATA/PULL: the fp32 payload and its reply's are in the sender's shared-memory
    #          region for that shard (shared_region.py), not on the wire; an error reply carries no payload
    INT8 = 16  # PUSH_PULL/PUSH_DATA: the request's payload is block-quantized to int8 (wire_codec.BlockCodec);
    #            with BF16 also set, its reply is bf16
    INT4 = 32  # the same with int4
    DIFF = 64  # PUSH_PULL/PULL with BF16: the requester holds a pulled copy of the shard; the reply is the int8
    #            block-quantized difference from it (codecs.PulledCopy), which both ends add to their copy
    KEEP = 128  # PUSH_PULL/PULL with BF16: the reply is bf16, and both ends keep it as the copy


#: the flag of each block-quantized push, by its bits
BLOCK_FLAGS = {8: Flag.INT8, 4: Flag.INT4}


@dataclass
class Header:
    """Decoded header. ``arg0..arg3`` meaning depends on ``kind`` (documented at each use).

    The fields travel in the order they are declared here, after the magic and the wire version.
    """

    kind: int
    sender: int
    shard: int = -1
    numel: int = 0  # fp32 payload elements that follow
    n_hyper: int = 0  # fp64 payload elements that follow
    seq: int = 0
    status: int = Status.OK
    flags: int = 0
    arg0: int = 0
    arg1: int = 0
    arg2: int = 0
    arg3: int = 0

    def encode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        t = out if out is not None else torch.empty(HEADER_LEN, dtype=torch.int64)
        t.zero_()
        vals = [MAGIC, WIRE_VERSION, *(getattr(self, name) for name in _WIRE_ORDER)]
        t[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
        return t

    @staticmethod
    def decode(t: torch.Tensor) -> Header:
        v = t.tolist()
        if v[0] != MAGIC:
            raise RuntimeError(f"PS protocol error: bad header magic {v[0]:#x} (expected {MAGIC:#x})")
        if v[1] != WIRE_VERSION:
            raise RuntimeError(
                f"PS protocol error: peer speaks wire version {v[1]}, this process speaks {WIRE_VERSION} "
                "(mixed ivyplug versions in one job?)"
            )
        return Header(*v[2 : 2 + len(_WIRE_ORDER)])


#: the header's fields in their wire order (after the magic and the version)
_WIRE_ORDER = tuple(f.name for f in fields(Header))


def float_arg(value: float) -> int:
    """A float64 carried in an int64 header field (its bit pattern; NaN and Inf travel unchanged)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def arg_float(arg: int) -> float:
    """The float64 whose bits :func:`float_arg` put in a header field."""
    return float(struct.unpack("<d", struct.pack("<q", arg))[0])


def message_bytes(numel: int, n_hyper: int = 0) -> int:
    """Bytes one message moves: its header, ``numel`` fp32 words and ``n_hyper`` fp64 values."""
    return 8 * HEADER_LEN + 4 * numel + 8 * n_hyper


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def bytes_to_words(blob: bytes) -> torch.Tensor:
    """Raw bytes as a float32 tensor (zero-padded to whole words; bit patterns travel unchanged)."""
    padded = bytearray(blob) + bytearray((-len(blob)) % 4)
    if not padded:
        return torch.zeros(0, dtype=torch.float32)
    return torch.frombuffer(padded, dtype=torch.uint8).clone().view(torch.float32)


def words_to_bytes(words: torch.Tensor, nbytes: int) -> bytes:
    return words.contiguous().view(torch.uint8).numpy().tobytes()[:nbytes]
