"""A restored state whose layout is not the script's: what a worker's error output says about it, in one line.

A checkpoint written by another model or optimizer (another `--d-model`, another script) cannot be loaded, and
trying again cannot change that: the job must stop at once, naming the mismatch, not retry --max-fallbacks times
(issue 29). The worker's own error is torch's `load_state_dict` refusal (size mismatch, missing or unexpected
keys, optimizer parameter groups) or phoenixrun's restore check (`restore: ...`); its agent reads it from the
tail of the worker's stderr. Pure.
"""
from __future__ import annotations

import re

# what marks a worker's output as a state-layout refusal (a cheap test before the parse)
MARKERS = ("size mismatch for ", "Missing key(s) in state_dict", "Unexpected key(s) in state_dict",
           "loaded state dict has a different number of parameter groups",
           "loaded state dict contains a parameter group that doesn't match the size of optimizer's group",
           "restore: the snapshot does not match", "restore: model/")

_SIZE = re.compile(r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\(\[([^\]]*)\]\) from "
                   r"checkpoint, the shape in current model is torch\.Size\(\[([^\]]*)\]\)")
_KEYS = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: ((?:\"[^\"]+\"(?:, )?)+)")
_OURS = re.compile(r"(restore: (?:the snapshot does not match|model/)[^\n]*)")


def _shape(dims: str) -> str:
    return "[" + ", ".join(d.strip() for d in dims.split(",") if d.strip()) + "]"


def state_mismatch(text: str) -> str | None:
    """The mismatch a worker's error output names, in one line; None if it names none."""
    if not any(m in text for m in MARKERS):
        return None
    sizes = _SIZE.findall(text)
    if sizes:
        name, saved, live = sizes[0]
        more = f" (and {len(sizes) - 1} more tensors of other shapes)" if len(sizes) > 1 else ""
        return f"{name} has shape {_shape(saved)} in the checkpoint, {_shape(live)} in the script's model{more}"
    keys = _KEYS.findall(text)
    if keys:
        parts = []
        for kind, listed in keys:
            names = re.findall(r"\"([^\"]+)\"", listed)
            extra = f" and {len(names) - 1} more" if len(names) > 1 else ""
            parts.append(f"the checkpoint lacks {names[0]}{extra}" if kind == "Missing"
                         else f"the checkpoint holds {names[0]}{extra} that the script's model does not have")
        return "; ".join(parts)
    if "parameter group" in text:
        return "the optimizer's parameter groups differ from the checkpoint's (another optimizer or model)"
    ours = _OURS.search(text)
    return ours.group(1).strip() if ours else "the checkpoint's state does not match the script's model"
