"""TorchLinear's `groups` G (G linears of one [N, K] in one node: X [..., G*K], W [G*N, K]
or its panels, Y [..., G*N]) against the graph it replaces: X split into its groups, one
TorchLinear per group, the results concatenated (then a Cast pair where rounded). Bit for
bit on every instruction-set path, both weight layouts, constant and fed W, 1 and 2 threads,
rounding on and off, decode and prefill shapes; clear errors; grouped packing; and the
portable spelling (a node per group) against the per-group portable graph."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper, numpy_helper
from test_torch_linear import (
    ISAS,
    W_TYPES,
    Errors,
    bf16_round,
    bits,
    dp_calls,
    has_avx512bf16,
    session_for,
)

from csa2onnx.custom_ops.ops import round_bf16, torch_linear
from csa2onnx.custom_ops.weight_layout import (
    PackedWeight,
    pack_panels,
    packed_later,
    panels_shape,
    unpack_panels,
)
from csa2onnx.graphs.standalone import build_model

# (X's leading dims, N, K, G): decode rows (M = 1, batch 4), odd N and K (past the 64-column
# panels, odd k-pairs, the vector widths), the tiny problems torch sums another way (bf16:
# M*N*K <= 4096; f32: MKL's 4 lanes below 4 rows or 12 columns), K cut into chunks, more
# rows than a task holds (48 fmaf, 96 vdpbf16ps), G = 1, 3 and 8.
SHAPES = [
    ((1,), 70, 31, 3), ((4, 1), 64, 96, 8), ((2, 3), 13, 7, 3), ((1, 1), 9, 14, 8),
    ((97,), 65, 130, 1), ((3, 35), 20, 1100, 3), ((1, 5), 129, 40, 8), ((2, 50), 33, 77, 3),
    ((3,), 70, 31, 3),
]
LAYOUTS = ("plain", "panels64")


def w_tensor(name: str, w: np.ndarray, w_type: str, layout: str, groups: int) -> object:
    """W (float32 values, [G*N, K]) as an initializer in its type and layout."""
    if w_type == "bf16":
        values = w.astype(ml_dtypes.bfloat16)
        if layout == "panels64":
            values = pack_panels(values, groups).panels
        return helper.make_tensor(name, TensorProto.BFLOAT16, values.shape,
                                  values.view(np.uint16).tobytes(), raw=True)
    values = pack_panels(w, groups).panels if layout == "panels64" else w
    return numpy_helper.from_array(np.ascontiguousarray(values, np.float32), name)


def w_value(w: np.ndarray, w_type: str, layout: str, groups: int) -> ort.OrtValue:
    """W as a fed input (OrtValue) in its type and layout."""
    values = w.astype(ml_dtypes.bfloat16) if w_type == "bf16" else np.asarray(w, np.float32)
    if layout == "panels64":
        values = pack_panels(values, groups).panels
    if w_type == "bf16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(values).view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(values))


def linear_attrs(n: int, k: int, layout: str, groups: int, rounded: bool) -> dict:
    attrs: dict = {"round_output": 1} if rounded else {}
    if groups != 1:
        attrs["groups"] = groups
    if layout == "panels64":
        attrs |= {"weight_layout": "panels64", "out_features": n, "in_features": k}
    return attrs


def grouped_model(w: np.ndarray, w_type: str, layout: str, groups: int, *, const: bool,
                  rounded: bool) -> bytes:
    """Y = TorchLinear(X, W, groups=G): W an initializer (`const`) or the input W."""
    n, k = w.shape[0] // groups, w.shape[1]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)]
    initializers = []
    if const:
        initializers.append(w_tensor("W", w, w_type, layout, groups))
    else:
        inputs.append(helper.make_tensor_value_info("W", W_TYPES[w_type], None))
    node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx",
                            **linear_attrs(n, k, layout, groups, rounded))
    graph = helper.make_graph([node], "grouped", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializers)
    return custom_op_model(graph)


def per_group_model(w: np.ndarray, w_type: str, layout: str, groups: int, *,
                    rounded: bool) -> bytes:
    """What the grouped node replaces: X split into G groups, TorchLinear(X_g, W_g) each
    (W_g its own constant [N, K]), Concat, and the Cast pair where rounded."""
    n, k = w.shape[0] // groups, w.shape[1]
    xs, ys = [f"X{g}" for g in range(groups)], [f"Y{g}" for g in range(groups)]
    nodes = [helper.make_node("Split", ["X"], xs, axis=-1, num_outputs=groups)]
    initializers = [w_tensor(f"W{g}", w[g * n:(g + 1) * n], w_type, layout, 1)
                    for g in range(groups)]
    nodes += [helper.make_node("TorchLinear", [xs[g], f"W{g}"], [ys[g]], domain="csa2onnx",
                               **linear_attrs(n, k, layout, 1, False)) for g in range(groups)]
    nodes.append(helper.make_node("Concat", ys, ["C" if rounded else "Y"], axis=-1))
    if rounded:
        nodes += [helper.make_node("Cast", ["C"], ["B"], to=TensorProto.BFLOAT16),
                  helper.make_node("Cast", ["B"], ["Y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "per_group",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializers)
    return custom_op_model(graph)


def sessions_or_skip(models: list[bytes], isa: str, threads: int = 0) -> list:
    try:
        return [session_for(m, isa, threads) for m in models]
    except Errors as e:
        assert "does not support it" in str(e)
        pytest.skip(f"this CPU has no {isa} path")


def inputs_for(rng: np.random.Generator, lead: tuple[int, ...], n: int, k: int,
               groups: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16-valued X [*lead, G*K] and W [G*N, K] (so that avx512bf16 takes vdpbf16ps)."""
    x = bf16_round(rng.standard_normal((*lead, groups * k)).astype(np.float32))
    w = bf16_round(rng.standard_normal((groups * n, k)).astype(np.float32))
    return x, w


def run_grouped(session: ort.InferenceSession, x: np.ndarray, w: np.ndarray | None = None,
                w_type: str = "f32", layout: str = "plain", groups: int = 1) -> np.ndarray:
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, np.float32))}
    if w is not None:
        feeds["W"] = w_value(w, w_type, layout, groups)
    return session.run_with_ort_values(["Y"], feeds)[0].numpy()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_groups_give_the_per_group_bits_on_every_path(isa: str, layout: str,
                                                      w_type: str) -> None:
    rng = np.random.default_rng(71)
    for lead, n, k, groups in SHAPES:
        x, w = inputs_for(rng, lead, n, k, groups)
        for rounded in (False, True):
            grouped, fed, want = sessions_or_skip(
                [grouped_model(w, w_type, layout, groups, const=True, rounded=rounded),
                 grouped_model(w, w_type, layout, groups, const=False, rounded=rounded),
                 per_group_model(w, w_type, layout, groups, rounded=rounded)], isa)
            expected = run_grouped(want, x)
            assert expected.shape == (*lead, groups * n)
            msg = f"{isa} {w_type} {layout} X {x.shape} N={n} K={k} G={groups} round={rounded}"
            np.testing.assert_array_equal(bits(run_grouped(grouped, x)), bits(expected),
                                          err_msg=msg)
            np.testing.assert_array_equal(
                bits(run_grouped(fed, x, w, w_type, layout, groups)), bits(expected),
                err_msg=msg + " (W fed)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_take_vdpbf16ps_and_fall_back_with_the_same_bits(layout: str) -> None:
    """Where the CPU has AVX512_BF16, a grouped call of bf16-exact X runs on vdpbf16ps (the
    counter moves) and one of X that is not bf16-exact on the fmaf tiles: both the
    per-group bits. 800 rows of K = 4095 convert X in batches of 2 groups (at most 2^22
    pairs a batch), 100 rows in one; on an AMX CPU 1 to 4 rows take their panels two at a
    time, 5 a group here (two pairs, then one alone: a pair never spans two groups)."""
    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    rng = np.random.default_rng(72)
    n, k, groups = 300, 4095, 3
    _, w = inputs_for(rng, (1,), n, k, groups)
    grouped, want = sessions_or_skip(
        [grouped_model(w, "bf16", layout, groups, const=True, rounded=False),
         per_group_model(w, "bf16", layout, groups, rounded=False)], "avx512bf16")
    for rows in (1, 2, 3, 4, 100, 800):
        exact = bf16_round(rng.standard_normal((rows, groups * k)).astype(np.float32))
        for x, on_dp in ((exact, True), (exact + np.float32(2.0 ** -20), False)):
            before = dp_calls()
            got = run_grouped(grouped, x)
            assert (dp_calls() > before) == on_dp, (rows, on_dp)
            np.testing.assert_array_equal(bits(got), bits(run_grouped(want, x)))


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_groups_thread_count_does_not_change_a_bit(w_type: str) -> None:
    rng = np.random.default_rng(73)
    x, w = inputs_for(rng, (2, 61), 100, 96, 8)
    decode = x[:, :1]
    models = [grouped_model(w, w_type, "panels64", 8, const=True, rounded=True)]
    one = sessions_or_skip(models, None, threads=1)[0]
    two = sessions_or_skip(models, None, threads=2)[0]
    for rows in (x, decode):
        np.testing.assert_array_equal(bits(run_grouped(one, rows)), bits(run_grouped(two, rows)))


def test_groups_empty_shapes() -> None:
    rng = np.random.default_rng(74)
    _, w = inputs_for(rng, (1,), 5, 6, 3)
    session = session_for(grouped_model(w, "bf16", "plain", 3, const=True, rounded=False))
    assert run_grouped(session, np.zeros((0, 18), np.float32)).shape == (0, 15)
    assert run_grouped(session, np.zeros((2, 0, 18), np.float32)).shape == (2, 0, 15)
    empty = session_for(grouped_model(np.zeros((6, 0), np.float32), "f32", "plain", 3,
                                      const=False, rounded=False))
    y = run_grouped(empty, np.zeros((4, 0), np.float32), np.zeros((6, 0), np.float32))
    np.testing.assert_array_equal(y, np.zeros((4, 6), np.float32))


# ---------------------------------------------------------------------------- errors
def fed_run(model: bytes, x: np.ndarray, w: ort.OrtValue) -> None:
    session_for(model).run_with_ort_values(
        ["Y"], {"X": ort.OrtValue.ortvalue_from_numpy(x), "W": w})


def test_bad_groups_are_clear_errors() -> None:
    w = bf16_round(np.random.default_rng(75).standard_normal((24, 16)).astype(np.float32))
    for groups in (0, -2):
        node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx",
                                groups=groups)
        graph = helper.make_graph(
            [node], "bad", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
            [w_tensor("W", w, "bf16", "plain", 1)])
        with pytest.raises(Errors, match=rf"TorchLinear: groups must be >= 1, got {groups}"):
            session_for(custom_op_model(graph))
    plain = grouped_model(w, "bf16", "plain", 3, const=False, rounded=False)
    with pytest.raises(Errors, match=r"TorchLinear: groups \(3\) must divide W's first "
                                     r"dimension \(G\*N\), got W shape \[25, 16\]"):
        fed_run(plain, np.ones((2, 48), np.float32), w_value(
            np.ones((25, 16), np.float32), "bf16", "plain", 1))
    for x_last in (47, 16, 64):
        with pytest.raises(Errors, match=rf"TorchLinear: the last dimension of X \({x_last}\) "
                                         r"must equal K, the second dimension of W \(16\) "
                                         r"times groups \(3\)"):
            fed_run(plain, np.ones((2, x_last), np.float32), w_value(w, "bf16", "plain", 3))
    panels = grouped_model(w, "bf16", "panels64", 3, const=False, rounded=False)
    with pytest.raises(Errors, match=r"TorchLinear: the last dimension of X \(32\) must equal "
                                     r"in_features \(16\) times groups \(3\)"):
        fed_run(panels, np.ones((2, 32), np.float32), w_value(w, "bf16", "panels64", 3))


def test_bad_grouped_panels_are_clear_errors() -> None:
    """Packed metadata that does not match: panels of another group count, out_features
    or in_features; padding that is not zero in a later group; an overflowing G*N."""
    w = bf16_round(np.random.default_rng(76).standard_normal((3 * 70, 31)).astype(np.float32))
    two = pack_panels(w[:140].astype(ml_dtypes.bfloat16), 2).panels
    three = pack_panels(w.astype(ml_dtypes.bfloat16), 3).panels

    def model(panels: np.ndarray, **attrs: object) -> bytes:
        node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx",
                                **({"weight_layout": "panels64", "out_features": 70,
                                    "in_features": 31, "groups": 3} | attrs))
        graph = helper.make_graph(
            [node], "bad", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
            [helper.make_tensor("W", TensorProto.BFLOAT16, panels.shape,
                                panels.view(np.uint16).tobytes(), raw=True)])
        return custom_op_model(graph)

    for bad, message in [
        (model(two), r"a panels64 W \(bfloat16\) for out_features 70 and in_features 31 in 3 "
                     r"groups must have shape \[6, 16, 64, 2\] \(\[3\*ceil\(N/64\), ceil\(K/2\), "
                     r"64, 2\]\), got \[4, 16, 64, 2\]"),
        (model(three, groups=2), r"in 2 groups must have shape \[4, 16, 64, 2\]"),
        (model(three, out_features=130), r"must have shape \[9, 16, 64, 2\]"),
        (model(three, in_features=33), r"must have shape \[6, 17, 64, 2\]"),
        (model(three, out_features=2**62), r"groups \(3\) times out_features \(4611686018427387904"
                                           r"\) or in_features \(31\) does not fit in int64"),
    ]:
        with pytest.raises(Errors, match="TorchLinear: .*" + message):
            session_for(bad)
    for where, group, column in (((3, 2, 6, 0), 1, 70), ((5, 15, 5, 1), 2, 69)):
        padded = three.copy()
        padded[where] = 1.0  # past N in group 1's last panel; an odd K's unused half
        with pytest.raises(Errors, match=rf"TorchLinear: a panels64 W must hold zeros in its "
                                         rf"padding; group {group}, column {column} \(N is 70\)"):
            session_for(model(padded))


# ------------------------------------------------------------- grouped packing (Python)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_grouped_panels_are_the_groups_panels_in_turn(dtype: type) -> None:
    rng = np.random.default_rng(77)
    for groups, n, k in ((1, 70, 31), (3, 70, 31), (8, 64, 32), (3, 5, 7), (2, 0, 4), (2, 3, 0)):
        w = rng.standard_normal((groups * n, k)).astype(dtype)
        packed = pack_panels(w, groups)
        assert packed.shape == w.shape and packed.groups == groups
        assert packed.panels.shape == panels_shape(n, k, np.dtype(dtype), groups)
        if n:
            each = [pack_panels(part).panels for part in np.split(w, groups)]
            np.testing.assert_array_equal(packed.panels.view(np.uint8),
                                          np.concatenate(each).view(np.uint8))
        np.testing.assert_array_equal(unpack_panels(packed).view(np.uint8), w.view(np.uint8))
        np.testing.assert_array_equal(packed_later(w, groups).packed().view(np.uint8),
                                      packed.panels.view(np.uint8))


def test_grouped_packing_errors() -> None:
    w = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"groups \(3\) must be >= 1 and divide the weight's "
                                         r"rows \(10\)"):
        pack_panels(w, 3)
    with pytest.raises(ValueError, match=r"groups \(0\)"):
        packed_later(w, 0)
    with pytest.raises(ValueError, match="has groups >= 1, got 0"):
        PackedWeight(None, 10, 4, plain=w, groups=0)
    with pytest.raises(ValueError, match=r"in 2 group\(s\) \(float32\) has shape \[2, 4, 64\]"):
        PackedWeight(pack_panels(w).panels, 5, 4, groups=2)


# ------------------------------------------------------------------- the portable form
F = ir.DataType.FLOAT


@pytest.mark.parametrize("rounded", [False, True])
def test_portable_groups_are_the_per_group_graph(rounded: bool) -> None:
    """In a portable graph the wrapper spells a grouped linear as a node per group (no
    grouped body): without the library it gives the per-group portable graph's bits, and
    with the library the grouped node's."""
    rng = np.random.default_rng(78)
    n, k, groups = 20, 48, 3
    x, w = inputs_for(rng, (2, 5), n, k, groups)
    wb = w.astype(ml_dtypes.bfloat16)

    def grouped(op, xv):
        weight = op.Constant(value=ir.tensor(wb))
        return torch_linear(op, xv, weight, rounded=rounded, groups=groups)

    def per_group(op, xv):
        parts = op.Split(xv, axis=-1, num_outputs=groups, _outputs=groups)
        ys = [torch_linear(op, part, op.Constant(value=ir.tensor(wb[g * n:(g + 1) * n])))
              for g, part in enumerate(parts)]
        y = op.Concat(*ys, axis=-1)
        return round_bf16(op, y) if rounded else y

    inputs = [("x", F, [2, 5, groups * k])]
    models = {(name, portable): build_model(name, inputs, ["y"], body, portable=portable)
              for name, body in (("grouped", grouped), ("per_group", per_group))
              for portable in (False, True)}
    plain = {key: ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
             for key, m in models.items() if key[1]}
    np.testing.assert_array_equal(bits(plain[("grouped", True)]),
                                  bits(plain[("per_group", True)]))
    with_library = {key: session_for(m.SerializeToString()).run(None, {"x": x})[0]
                    for key, m in models.items()}
    assert len({bits(y).tobytes() for y in with_library.values()}) == 1
    assert [node.op_type for node in models[("grouped", False)].graph.node
            if node.domain == "csa2onnx"] == ["TorchLinear"]
