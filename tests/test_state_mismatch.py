"""The one line that names a restored state of another model or optimizer, from the worker's error output
(faults/mismatch.py, issue 29 item 1); the job itself: tests/test_e2e_run_identity.py."""
import pytest

from phoenixrun.faults.mismatch import state_mismatch

TORCH_SIZE = ("RuntimeError: Error(s) in loading state_dict for DistributedDataParallel:\n"
              "\tsize mismatch for module.tok.weight: copying a param with shape torch.Size([1024, 256]) from "
              "checkpoint, the shape in current model is torch.Size([1024, 64]).\n"
              "\tsize mismatch for module.ln.bias: copying a param with shape torch.Size([256]) from checkpoint, the "
              "shape in current model is torch.Size([64]).\n")


@pytest.mark.parametrize("text, says", [
    ("", None),
    ("Traceback ...\nValueError: user error at step 3\n", None),
    (TORCH_SIZE, "module.tok.weight has shape [1024, 256] in the checkpoint, [1024, 64] in the script's model "
                 "(and 1 more tensors of other shapes)"),
    ('RuntimeError: Error(s) in loading state_dict for GPT:\n\tMissing key(s) in state_dict: "blocks.1.w", '
     '"blocks.1.b". \n', "the checkpoint lacks blocks.1.w and 1 more"),
    ('\tUnexpected key(s) in state_dict: "extra.w". \n', "the checkpoint holds extra.w that the script's model"),
    ("ValueError: loaded state dict contains a parameter group that doesn't match the size of optimizer's group",
     "the optimizer's parameter groups differ"),
    ("ValueError: restore: model/w holds a local shard of shape (4,), the snapshot one of (8,)\n",
     "restore: model/w holds a local shard"),
])
def test_state_mismatch(text, says):
    got = state_mismatch(text)
    assert (got is None) if says is None else (says in got and "\n" not in got)
