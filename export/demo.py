"""A short end-to-end check: export a tiny model that uses both custom ops, run it in
onnxruntime, and compare it with the unit goldens (`python -m csa2onnx.export.demo`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops.ops import fp4_quant_dequant, torch_topk
from csa2onnx.graphs.numerics import FLOAT, INT64
from csa2onnx.graphs.standalone import build_model

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"


def _tiny_model(block: int, scale_format: str, sorted_: bool):
    def body(op, x, scores, k):
        values, indices = torch_topk(op, scores, k, sorted=sorted_)
        return fp4_quant_dequant(op, x, block, scale_format), values, indices

    inputs = [("x", FLOAT, ["n", "d"]), ("scores", FLOAT, ["rows", "width"]), ("k", INT64, [1])]
    return build_model("demo", inputs, ["fp4", "values", "indices"], body)


def main() -> int:
    unit = np.load(GOLDENS / "unit_kernels.npz")
    meta = json.loads((GOLDENS / "unit_kernels.json").read_text())
    checked = failed = 0
    for fp4_tag, block, fmt in [("e8m0_b32.edge", 32, "e8m0"), ("e4m3_b16.edge", 16, "e4m3")]:
        for sorted_ in (True, False):
            session = make_session(_tiny_model(block, fmt, sorted_).SerializeToString())
            mode = "sorted" if sorted_ else "unsorted"
            for case in meta["topk"]["cases"]:
                tag = case["tag"]
                if f"topk.{tag}.{mode}.indices" not in unit:
                    continue
                scores = unit[f"topk.{tag}.input"].reshape(-1, case["n"])
                fp4, values, indices = session.run(None, {
                    "x": unit[f"fp4.{fp4_tag}.input"], "scores": scores,
                    "k": np.array([case["k"]], np.int64)})
                ok = (np.array_equal(fp4.view(np.uint32),
                                     unit[f"fp4.{fp4_tag}.output"].view(np.uint32))
                      and np.array_equal(indices.reshape(-1),
                                         unit[f"topk.{tag}.{mode}.indices"].reshape(-1))
                      and np.array_equal(values.reshape(-1),
                                         unit[f"topk.{tag}.{mode}.values"].reshape(-1),
                                         equal_nan=True))
                checked += 1
                failed += not ok
                if not ok:
                    print(f"MISMATCH fp4 {fp4_tag} / topk {tag} {mode}")
    print(f"demo: Fp4QuantDequant + TorchTopK in onnxruntime vs unit goldens: "
          f"{checked - failed} of {checked} checks bit-exact")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
