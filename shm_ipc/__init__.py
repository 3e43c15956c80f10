"""Rank 0 → workers plan channel: a shared-memory ring with a ZeroMQ doorbell, the StepPlan and
ControlCall wire formats, and the workers → rank 0 error channel. Nothing is ever unpickled; nothing here knows what a
model is.

    rank 0:   bc = PlanBroadcaster(num_readers=N - 1)
              send bc.handle.to_bytes() to the workers (a uint8 tensor over torch.distributed)
              bc.wait_for_readers(); bc.publish(plan or call) per step; bc.poll_errors(); bc.close()
    worker:   rx = PlanReceiver(ChannelHandle.from_bytes(raw), rank)
              msg = rx.recv() per step (a StepPlan, or a ControlCall between steps)
              rx.report_error(step_id, exc) on failure; rx.close()
"""

from shm_ipc.broadcaster import PlanBroadcaster
from shm_ipc.control_call import ControlCall, ControlDecodeError
from shm_ipc.error_channel import WorkerErrorReport
from shm_ipc.errors import (
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    CorruptMessageError,
    OwnerDiedError,
    ReaderDiedError,
    WorkerError,
)
from shm_ipc.handle import ChannelHandle
from shm_ipc.receiver import PlanReceiver
from shm_ipc.step_plan import Command, PlanDecodeError, StepPlan

__all__ = [
    "ChannelClosed",
    "ChannelError",
    "ChannelHandle",
    "ChannelTimeout",
    "Command",
    "ControlCall",
    "ControlDecodeError",
    "CorruptMessageError",
    "OwnerDiedError",
    "PlanBroadcaster",
    "PlanDecodeError",
    "PlanReceiver",
    "ReaderDiedError",
    "StepPlan",
    "WorkerError",
    "WorkerErrorReport",
]
