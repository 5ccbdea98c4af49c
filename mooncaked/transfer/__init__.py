"""Transfer engine: batched READ/WRITE of registered memory between nodes over
TCP, shared memory (same host) and RDMA (where a NIC exists)."""

from mooncaked.transfer.access import Access, WriteGrant
from mooncaked.transfer.batch import (
    Batch,
    OpKind,
    OpStatus,
    TransferError,
    TransferMetrics,
    TransferOp,
)
from mooncaked.transfer.engine import TransferEngine
from mooncaked.transfer.segment import (
    Segment,
    SegmentDescriptor,
    SegmentError,
    SharedBuffer,
)

__all__ = [
    "Access",
    "Batch",
    "OpKind",
    "OpStatus",
    "Segment",
    "SegmentDescriptor",
    "SegmentError",
    "SharedBuffer",
    "TransferEngine",
    "TransferError",
    "TransferMetrics",
    "TransferOp",
    "WriteGrant",
]
