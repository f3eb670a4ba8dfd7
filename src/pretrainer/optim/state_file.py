"""Optimizer state on disk: quantised moments (torchao's tensor subclasses) written as their plain
parts, so optimizer.pt loads with torch.load(weights_only=True), and rebuilt from an allow-list of
classes (optim/lowbit.py), never from a name the file gives."""

from __future__ import annotations

import torch

from pretrainer.optim.sizes import is_quantised


def state_for_file(state: dict) -> dict:
    """An optimizer state dict with each quantised moment written as its plain parts, so optimizer.pt
    loads with torch.load(weights_only=True): {"tensor_subclass": class name, "tensors": {...}, "attributes":
    [...]}."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if is_quantised(value):
            names, attributes = value.__tensor_flatten__()
            return {
                "tensor_subclass": type(value).__name__,
                "tensors": {n: getattr(value, n) for n in names},
                "attributes": [
                    {"dtype": str(a).removeprefix("torch.")}
                    if isinstance(a, torch.dtype)
                    else {"shape": list(a)}
                    if isinstance(a, torch.Size)
                    else a
                    for a in attributes
                ],
            }
        return value

    return plain(state)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def state_from_file(state: dict) -> dict:
    """state_for_file's inverse; the classes come from optim/lowbit.py's list, never from the file."""

    def rebuilt(value):
        if isinstance(value, dict) and "tensor_subclass" in value:
            from pretrainer.optim.lowbit import STATE_CLASSES

            cls = STATE_CLASSES.get(value["tensor_subclass"])
            if cls is None:
                raise ValueError(f"unknown optimizer state class {value['tensor_subclass']!r}")
            attributes = [
                _dtype(a["dtype"])
                if isinstance(a, dict) and "dtype" in a
                else torch.Size(a["shape"])
                if isinstance(a, dict) and "shape" in a
                else a
                for a in value["attributes"]
            ]
            return cls.__tensor_unflatten__(value["tensors"], attributes, None, None)
        if isinstance(value, dict):
            return {k: rebuilt(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rebuilt(v) for v in value]
        return value

    return rebuilt(state)
