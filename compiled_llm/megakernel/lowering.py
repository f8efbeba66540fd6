"""The post-pass program's decode step as megakernel ops.

A decode step has one token per sequence, so the program's rows are its sequences and the
selection of each sequence's last row before the lm_head is the identity. The graph is walked
in order and each node is matched to what the instruction set covers:

  embedding                                    -> embed
  fused_qkv_rope + the paged_attention it feeds -> qkv_rope (which stores the layer's KV) + attention
                                                  (split along the context) + attention_combine
  fused_linear_residual, linear                -> linear (with and without a residual)
  fused_rms_norm_glu_mlp                       -> glu + linear (down + residual)
  rms_norm + linear -> the graph's output      -> lm_head + argmax
  views, the KV cache's layer select, the last-row selection: no op

Any other node is refused with one line naming it (``lower_decode`` raises ``NotCovered``), so a
family, a quantization or a sharded program the instruction set does not cover yet is known at
build time. Kernel providers' ops (``cllm::<op>__<provider>``) count as their op.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any, Mapping

import torch

from compiled_llm.errors import CompiledLLMError
from compiled_llm.graph.export import PARAM_META
from compiled_llm.graph.ops import OPS
from compiled_llm.megakernel import tiling
from compiled_llm.megakernel.schedule import Buffer, Op


class NotCovered(CompiledLLMError):
    """The program has a node the megakernel's instruction set does not cover."""


@dataclasses.dataclass(frozen=True)
class DecodeOps:
    buffers: tuple[Buffer, ...]
    ops: tuple[Op, ...]
    logits: str
    tokens: str


def op_name(node: torch.fx.Node) -> str:
    """"cllm.fused_qkv_rope", "aten.linear" or "operator.getitem": what ``node`` calls, a kernel
    provider's op as the op it provides."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns, _, rest = target.name().partition("::")
        return f"{ns}.{rest.split('.')[0].partition('__')[0]}"
    if target is operator.getitem:
        return "operator.getitem"
    return repr(target)


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """A cllm:: node's arguments by name, defaults filled in."""
    op = OPS[op_name(node).removeprefix("cllm.")]
    values = dict(zip(op.params, node.args))
    values.update(node.kwargs)
    for name, p in inspect.signature(op.reference).parameters.items():
        if name not in values:
            values[name] = p.default
    return values


class _Lowering:
    def __init__(self, shapes: Mapping[str, tuple[int, ...]], num_sms: int, splits: int | None):
        self.shapes, self.num_sms, self.splits = shapes, num_sms, splits
        self.env: dict[torch.fx.Node, tuple] = {}
        self.buffers: dict[str, Buffer] = {}
        self.ops: list[dict] = []
        self.pending_qkv: dict[int, dict] = {}  # op index -> its qkv_rope op, until its attention names the layer

    # ---- values ------------------------------------------------------------------------------

    def refuse(self, node: torch.fx.Node, why: str = "") -> NotCovered:
        return NotCovered(f"the megakernel backend does not cover node {node.name} ({op_name(node)}"
                          f"{': ' + why if why else ''}); build it with --decode-backend per-op")

    def new_buffer(self, stem: str, cols: int, dtype: str = "act") -> str:
        name = f"{stem}{len(self.buffers)}"
        self.buffers[name] = Buffer(name, cols, dtype)
        return name

    def param(self, node: torch.fx.Node, value) -> str | None:
        if value is None:
            return None
        kind = self.env.get(value)
        if kind is None or kind[0] != "param":
            raise self.refuse(node, f"{getattr(value, 'name', value)} is not a weight")
        return kind[1]

    def buf(self, node: torch.fx.Node, value) -> str:
        kind = self.env.get(value) if isinstance(value, torch.fx.Node) else None
        if kind is None or kind[0] != "buf":
            raise self.refuse(node, f"{getattr(value, 'name', value)} is not an activation the instruction set holds")
        return kind[1]

    def add_op(self, kind: str, node: torch.fx.Node, layer: int, inputs, outputs, params, attrs, tiles, cols) -> dict:
        op = {"kind": kind, "name": node.name, "layer": layer, "inputs": tuple(inputs), "outputs": tuple(outputs),
              "params": {k: v for k, v in params.items() if v is not None}, "attrs": dict(attrs),
              "tiles": tiles, "tile_cols": cols}
        self.ops.append(op)
        return op

    def column_op(self, kind: str, node, layer: int, inputs, n: int, params, attrs, dtype: str = "act") -> str:
        out = self.new_buffer(kind[0], n, dtype)
        width = tiling.tile_cols(n, self.num_sms)
        self.add_op(kind, node, layer, inputs, (out,), params, {**attrs, "cols": n}, -(-n // width), width)
        return out

    # ---- nodes -------------------------------------------------------------------------------

    def run(self, gm: torch.fx.GraphModule) -> DecodeOps:
        result = None
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                name = node.meta.get(PARAM_META)
                self.env[node] = ("param", name) if name is not None else ("input", node.name)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                result = self.output(node)
        for op in self.pending_qkv.values():
            raise NotCovered(f"the megakernel backend does not cover node {op['name']}: its q/k/v feed no paged "
                             "attention; build it with --decode-backend per-op")
        return result

    def call(self, node: torch.fx.Node) -> tuple:
        name = op_name(node)
        handler = getattr(self, "on_" + name.replace(".", "_"), None)
        if handler is None:
            raise self.refuse(node)
        return handler(node)

    def on_aten_sym_size(self, node):
        return ("rows",)

    def on_aten_view(self, node):
        x, shape = node.args
        src = self.env.get(x)
        if src is None or src[0] != "buf" or len(shape) != 2 or shape[1] != self.buffers[src[1]].cols:
            raise self.refuse(node, "a view the instruction set does not hold")
        return src

    def on_aten_embedding(self, node):
        weight, tokens = node.args
        if self.env.get(tokens) != ("input", "token_ids"):
            raise self.refuse(node, "an embedding of something other than the step's tokens")
        w = self.param(node, weight)
        return ("buf", self.column_op("embed", node, -1, (), self.shapes[w][1], {"weight": w}, {}))

    def on_aten_select(self, node):
        src, dim, layer = node.args
        if self.env.get(src) != ("input", "kv_cache") or dim != 0:
            raise self.refuse(node)
        return ("kv_layer", layer)

    def on_cllm_fused_qkv_rope(self, node):
        a = bound_args(node)
        x = self.buf(node, a["x"])
        if self.env.get(a["positions"]) != ("input", "positions"):
            raise self.refuse(node, "rotary positions other than the step's")
        nh, nkv, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        q = self.new_buffer("q", nh * hd)
        params = {"weight": self.param(node, a["qkv_weight"]), "bias": self.param(node, a["qkv_bias"]),
                  "q_norm": self.param(node, a["q_norm_weight"]), "k_norm": self.param(node, a["k_norm_weight"]),
                  "cos_sin": self.param(node, a["cos_sin"]), "norm": self.param(node, a["norm_weight"])}
        attrs = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd, "eps": a["eps"], "norm_eps": a["norm_eps"]}
        op = self.add_op("qkv_rope", node, -1, (x,), (q,), params, attrs, nh + 2 * nkv, hd)
        self.pending_qkv[len(self.ops) - 1] = op
        return ("qkv", len(self.ops) - 1)

    def on_operator_getitem(self, node):
        src, i = node.args
        kind = self.env.get(src)
        if kind is None or kind[0] != "qkv":
            raise self.refuse(node)
        return ("qkv_part", kind[1], i)

    def on_cllm_paged_attention(self, node):
        a = bound_args(node)
        parts = [self.env.get(a[k]) for k in ("q", "k", "v")]
        if any(p is None or p[0] != "qkv_part" for p in parts) or [p[2] for p in parts] != [0, 1, 2] \
                or len({p[1] for p in parts}) != 1:
            raise self.refuse(node, "attention over q/k/v that one fused_qkv_rope did not make")
        layer = self.env.get(a["kv_cache"])
        if layer is None or layer[0] != "kv_layer":
            raise self.refuse(node, "a KV cache other than one layer of the engine's")
        for key, want in (("slot_mapping", "slot_mapping"), ("query_start_loc", "query_start_loc"),
                          ("seq_lens", "seq_lens"), ("block_tables", "block_tables")):
            if self.env.get(a[key]) != ("input", want):
                raise self.refuse(node, f"its {key} is not the step's")
        qkv_index = parts[0][1]
        qkv = self.pending_qkv.pop(qkv_index, None)
        if qkv is None:
            raise self.refuse(node, "a second attention over one fused_qkv_rope")
        l = layer[1]
        nh, nkv, hd = (qkv["attrs"][k] for k in ("num_heads", "num_kv_heads", "head_dim"))
        kv = f"kv{l}"
        if kv in self.buffers:
            raise self.refuse(node, f"a second attention over layer {l}'s cache")
        self.buffers[kv] = Buffer(kv, 2 * nkv, "act")
        qkv["outputs"] += (kv,)
        qkv["layer"] = l
        splits = self.splits or tiling.attention_splits(self.num_sms, nh)
        partial = self.new_buffer("p", nh * splits * (hd + 2), "float32")
        attrs = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd, "layer": l, "scale": a["scale"],
                 "sliding_window": a["sliding_window"], "softcap": a["softcap"], "splits": splits}
        self.add_op("attention", node, l, (qkv["outputs"][0], kv), (partial,), {}, attrs, nh * splits, hd + 2)
        out = self.new_buffer("o", nh * hd)
        self.add_op("attention_combine", node, l, (partial,), (out,), {},
                    {"num_heads": nh, "head_dim": hd, "splits": splits}, nh, hd)
        for user in (a["k"], a["v"]):
            if len(user.users) != 1:
                raise self.refuse(user, "k/v read by more than their attention")
        return ("buf", out)

    def linear_op(self, node, x: str, weight, bias, residual, role: str) -> tuple:
        """A linear of buffer ``x`` (+ the residual node's buffer), ``role`` "o", "down" or
        "linear" (what inspect's timeline calls it)."""
        w = self.param(node, weight)
        inputs = (x,) + ((self.buf(node, residual),) if residual is not None else ())
        if self.shapes[w][1] != self.buffers[x].cols:
            raise self.refuse(node, "a weight whose width is not its input's")
        return ("buf", self.column_op("linear", node, -1, inputs, self.shapes[w][0],
                                      {"weight": w, "bias": self.param(node, bias)}, {"role": role}))

    def role_of(self, x: str) -> str:
        return "o" if any(op["kind"] == "attention_combine" and x in op["outputs"] for op in self.ops) else "linear"

    def on_cllm_fused_linear_residual(self, node):
        a = bound_args(node)
        x = self.buf(node, a["x"])
        return self.linear_op(node, x, a["weight"], a["bias"], a["residual"], self.role_of(x))

    def on_cllm_linear(self, node):
        a = bound_args(node)
        x = self.buf(node, a["x"])
        return self.linear_op(node, x, a["weight"], a["bias"], None, self.role_of(x))

    def on_cllm_fused_rms_norm_glu_mlp(self, node):
        a = bound_args(node)
        x = self.buf(node, a["x"])
        gate_up = self.param(node, a["gate_up_weight"])
        inter = self.shapes[gate_up][0] // 2
        h = self.column_op("glu", node, -1, (x,), inter, {"norm": self.param(node, a["norm_weight"]),
                                                          "weight": gate_up},
                           {"eps": a["eps"], "activation": a["activation"]})
        return self.linear_op(node, h, a["down_weight"], None, a["residual"], "down")

    def on_aten_slice(self, node):
        src, dim, start, end = (list(node.args) + [None] * 4)[:4]
        if self.env.get(src) != ("input", "query_start_loc") or dim != 0 or start != 1 \
                or not (end is None or end >= 2 ** 62) or node.kwargs:
            raise self.refuse(node)
        return ("seq_ends",)

    def on_aten_sub(self, node):
        src, other = node.args
        if self.env.get(src) != ("seq_ends",) or other != 1:
            raise self.refuse(node)
        return ("last_rows",)

    def on_aten_index_select(self, node):
        x, dim, index = node.args
        if dim != 0 or self.env.get(index) != ("last_rows",):
            raise self.refuse(node, "a row selection other than each sequence's last token")
        if self.env.get(x, ("",))[0] != "buf":
            raise self.refuse(node)
        return self.env[x]

    def on_cllm_rms_norm(self, node):
        a = bound_args(node)
        return ("normed", self.buf(node, a["x"]), self.param(node, a["weight"]), a["eps"])

    def on_aten_linear(self, node):
        x, weight, *bias = node.args
        normed = self.env.get(x)
        users = list(node.users)
        if normed is None or normed[0] != "normed" or (bias and bias[0] is not None) or node.kwargs \
                or len(users) != 1 or users[0].op != "output":
            raise self.refuse(node, "a linear other than the final norm's lm_head")
        _, src, norm, eps = normed
        w = self.param(node, weight)
        vocab = self.shapes[w][0]
        width = tiling.tile_cols(vocab, self.num_sms)
        tiles = -(-vocab // width)
        logits = self.new_buffer("logits", vocab)
        best_val, best_idx = self.new_buffer("best_val", tiles, "float32"), self.new_buffer("best_idx", tiles, "int64")
        self.add_op("lm_head", node, -1, (src,), (logits, best_val, best_idx), {"norm": norm, "weight": w},
                    {"eps": eps, "cols": vocab}, tiles, width)
        tokens = self.new_buffer("tokens", 1, "int64")
        self.add_op("argmax", node, -1, (best_val, best_idx), (tokens,), {}, {}, 1, 1)
        return ("logits", logits, tokens)

    def output(self, node) -> DecodeOps:
        (values,) = node.args
        values = values if isinstance(values, (tuple, list)) else (values,)
        result = self.env.get(values[0]) if len(values) == 1 else None
        if result is None or result[0] != "logits":
            raise self.refuse(node, "a program whose output is not the lm_head's logits")
        ops = [Op(**{**op, "layer": op["layer"] if op["layer"] >= 0 else _layer_of(op, self.ops)}) for op in self.ops]
        return DecodeOps(tuple(self.buffers.values()), tuple(ops), result[1], result[2])


def _layer_of(op: dict, ops: list[dict]) -> int:
    """The layer of an op that names none: its input's producer's (the o and MLP ops follow
    their layer's attention), -1 before the first layer and after the last."""
    if op["kind"] in ("embed", "lm_head", "argmax"):
        return -1
    for other in ops:
        if op["inputs"] and op["inputs"][0] in other["outputs"] and other is not op:
            if other["layer"] >= 0:
                return other["layer"]
            return _layer_of(other, ops)
    return -1


def lower_decode(gm: torch.fx.GraphModule, shapes: Mapping[str, tuple[int, ...]], num_sms: int,
                 splits: int | None = None) -> DecodeOps:
    """The ops of ``gm``'s decode step (``shapes``: each weight's shape, by engine name), tiled
    for ``num_sms`` SMs; NotCovered (one line) for a node the instruction set lacks. Each
    attention's context is cut into ``tiling.attention_splits(num_sms, heads)`` splits, or
    ``splits`` when given (tests lay a split schedule onto one SM, where the SM count alone
    would give one split; an engine's schedule is always the SM count's, as the loader derives it)."""
    if splits is not None and not 1 <= splits <= tiling.MAX_SPLITS:
        raise ValueError(f"attention splits must be 1..{tiling.MAX_SPLITS}, not {splits}")
    return _Lowering(shapes, num_sms, splits).run(gm)
