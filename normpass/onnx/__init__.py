"""The ONNX front end, one room per pass.

* `graph/`: reading a model (onnx-ir) into the zero-mean graph: loading and the op table
  (`frontend`), graph queries (`values`), norm spellings (`patterns`), constant-like tensors
  (`constants`), and finishing a rewritten model for writing (`export`).
* `fold/`: the exact pass: the driver (`fold_onnx`, `inspect_onnx`, `FoldPass`), the rewrite,
  where γ/β can go (`targets`), the Skip fusion (`fuse`), flattened Gemms back to MatMuls (`matmul`).
* `rotate/`: the rotation of a folded stream: the proof and rewrite of each stream (`rotator`), key
  centring, smoothing, online rotation and the calibration statistics they share (`features`).
* `replace/`: the surrogate pass: capture, selection through `core.replace`, emission.
* `slice/`: SliceGPT's slicing of a proven stream: the driver (`slice_onnx`, `inspect_slice`: bases,
  judging) and the cut (`cut`: the rotation's rewriter with a d×k matrix, the RMS rescale, shapes).
* `calibrate/`: calibration running that the calibrated passes share: the inputs a model takes, batches
  read or made for it (`data`), ONNX Runtime over them (`runner`).
* `runtime/`: ONNX Runtime beside the passes: verification, benchmarking, fp16 copies, ORT's
  transformers optimizer.
* `graphsurgeon`: onnx-graphsurgeon graphs in and out.

Each room imports from `graph/`, `runtime/` and `calibrate/`, and the later passes from `fold/` (`slice`
from `rotate/`) through its public API or modules other than its driver; none imports another pass's
driver or a later pass (`tests/test_rooms.py`).
"""
