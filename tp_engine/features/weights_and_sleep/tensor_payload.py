"""SGLang's serialized named tensors (`/update_weights_from_tensor`), read without trusting them.

What arrives: SGLang's `MultiprocessingSerializer.serialize(named_tensors, output_str=True)`, i.e.
base64 of a `ForkingPickler` pickle of `[(name, tensor), ...]`. A tensor in such a pickle is a
handle to memory the sender shares (a CUDA IPC handle, or a CPU shared-memory file under torch's
"file_system" sharing strategy), not its bytes: the receiver maps the same memory. Pickle runs
whatever callable the payload names, so a plain `pickle.loads` of a request body is remote code
execution; this module's `TensorUnpickler` admits exactly the callables torch needs to rebuild
a shared tensor and the types they take as arguments, and refuses every other global:

    torch.multiprocessing.reductions  rebuild_tensor, rebuild_cuda_tensor,
                                      rebuild_typed_storage, rebuild_storage_filename,
                                      rebuild_storage_empty
    torch                             Tensor, Size, and the dtypes (torch.float32, ...)
    torch.storage                     UntypedStorage
    sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata
                                      mapped to `FlatTensorMeta` here, a plain record (SGLang's
                                      "flattened_bucket" load format, slime's colocated path:
                                      one uint8 tensor and where each named tensor lies in it)

Not admitted, so refused: anything else (`os.system`, `builtins.eval`, ...), torch's
`_load_from_bytes` (a plain `pickle.dumps` of a tensor, which runs `torch.load` unrestricted),
and `multiprocessing.resource_sharer.DupFd` (the "file_descriptor" strategy: it connects to the
sender's socket). The route that reads these is offered only with its own flag
(`--enable-weight-updates-from-tensor`), behind the API key, and the unpickling runs on rank 0,
where the weights are loaded from the tensors (`LLM.load_weights`' path).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch

_REBUILDERS = frozenset({
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
    "rebuild_storage_filename", "rebuild_storage_empty",
})  # fmt: skip


class TensorPayloadError(ValueError):
    """The payload is not SGLang's serialized named tensors, or names a refused global."""


class FlatTensorMeta:
    """Where one named tensor lies in a flattened bucket (SGLang's `FlattenedTensorMetadata`
    fields: name, shape, dtype, start_idx, end_idx, numel, set from the pickle's state)."""


class TensorUnpickler(pickle.Unpickler):
    """Admits torch's shared-tensor rebuild functions and their argument types only (see the
    module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _REBUILDERS:
            import torch.multiprocessing.reductions as reductions

            return getattr(reductions, name)
        if module == "torch" and name in ("Tensor", "Size"):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.storage" and name == "UntypedStorage":
            return torch.storage.UntypedStorage
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return FlatTensorMeta
        raise TensorPayloadError(
            f"the payload names {module}.{name}, which is not a torch tensor rebuild function"
        )


def decode_named_tensors(
    payload: str | bytes, load_format: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The `[(name, tensor), ...]` of one serialized payload (base64 text, or the pickle's
    bytes): the pairs themselves (`load_format` None), or cut from a flattened bucket
    ("flattened_bucket"). TensorPayloadError for anything else."""
    if load_format not in (None, "direct", "flattened_bucket"):
        raise TensorPayloadError(
            f"load_format {load_format!r}: only the default and 'flattened_bucket' are read"
        )
    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TensorPayloadError(f"the payload is not base64: {exc}") from None
    try:
        obj = TensorUnpickler(io.BytesIO(payload)).load()
    except TensorPayloadError:
        raise
    except Exception as exc:  # a truncated or foreign pickle raises many types
        raise TensorPayloadError(
            f"the payload cannot be read: {type(exc).__name__}: {exc}"
        ) from None
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    if not isinstance(obj, list | tuple) or not all(
        isinstance(item, list | tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in obj
    ):
        raise TensorPayloadError("the payload must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]


def _unflatten(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """SGLang's `FlattenedTensorBucket.reconstruct_tensors`, with every field checked."""
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise TensorPayloadError("a flattened bucket is {'flattened_tensor', 'metadata'}")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise TensorPayloadError("flattened_tensor must be a 1-d uint8 tensor")
    if not isinstance(metas, list) or not all(isinstance(m, FlatTensorMeta) for m in metas):
        raise TensorPayloadError("metadata must be a list of FlattenedTensorMetadata")
    named = []
    for m in metas:
        fields = vars(m)
        name, shape, dtype = fields.get("name"), fields.get("shape"), fields.get("dtype")
        start, end = fields.get("start_idx"), fields.get("end_idx")
        if not (
            isinstance(name, str)
            and isinstance(shape, tuple)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(dtype, torch.dtype)
            and type(start) is int
            and type(end) is int
            and 0 <= start <= end <= flat.numel()
            and start % dtype.itemsize == 0
            and end - start == torch.Size(shape).numel() * dtype.itemsize
        ):
            raise TensorPayloadError(f"bad metadata in a flattened bucket: {fields!r:.200}")
        named.append((name, flat[start:end].view(dtype).reshape(shape)))
    return named
