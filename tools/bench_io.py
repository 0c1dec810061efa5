"""Load and save one ONNX model in a fresh process, four ways, and print wall time and peak RSS.

The measurement behind the choice of onnx-ir as normpass's ONNX representation (docs/onnx-ir.md):

* ``onnx``: ``onnx.load`` + ``onnx.save`` with external data (the I/O floor);
* ``gs``: ``onnx_graphsurgeon.import_onnx`` + ``export_onnx`` + ``onnx.save`` (needs
  ``pip install onnx-graphsurgeon``, which normpass no longer depends on);
* ``ir``: ``onnx_ir.load`` + ``onnx_ir.save`` with external data;
* ``normpass``: ``fold_onnx(path, FoldOptions(verify=False)).save(OUT)``.

Usage (one process per measurement, so that peak RSS is that of the one job)::

    python tools/bench_io.py MODEL.onnx {onnx,gs,ir,normpass} OUT.onnx
"""

from __future__ import annotations

import os
import resource
import sys
import time


def main(path: str, how: str, out: str) -> None:
    import onnx

    data = os.path.basename(out) + ".data"
    start = time.perf_counter()
    if how == "onnx":
        onnx.save(onnx.load(path), out, save_as_external_data=True, location=data)
    elif how == "gs":
        import onnx_graphsurgeon as gs

        onnx.save(gs.export_onnx(gs.import_onnx(onnx.load(path))), out, save_as_external_data=True, location=data)
    elif how == "ir":
        import onnx_ir as ir

        ir.save(ir.load(path), out, external_data=data)
    elif how == "normpass":
        from normpass import FoldOptions, fold_onnx

        fold_onnx(path, FoldOptions(verify=False)).save(out)
    else:
        raise SystemExit(f"{how!r}: choose one of onnx, gs, ir, normpass")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{how}: {time.perf_counter() - start:.2f} s, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
