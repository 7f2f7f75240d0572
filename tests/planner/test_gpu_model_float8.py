"""The GPU model's float8 (issue 36): torchao's recipes, their casts and GEMMs as its Float8Linear
runs them, what calibration measures of them, float8 all-gather. Arithmetic only."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from gpu_model_jobs import H100, K100, llama8b

from titan_exp.config import compose_job
from titan_exp.perf.model import block as gpu
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates import float8_casts as f8c
from titan_exp.perf.rates import kernels as rates
from titan_exp.perf.rates import model_ops
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.profile import Kernels
from titan_exp.validation import resolve

pytestmark = pytest.mark.quick


def test_float8_recipes_pay_for_their_casts_and_their_gemms():
    def step(*o: str) -> float:
        job = llama8b("precision=float8", "compile.enable=true", *o)
        return predict_step(job, spec_profile(H100, 8, 8), cuda=True).step_s

    bf16 = predict_step(llama8b("compile.enable=true"), spec_profile(H100, 8, 8), cuda=True).step_s
    tensorwise, rowwise = step(), step("precision.float8_recipe=rowwise")
    high_gw = step("precision.float8_recipe=rowwise_with_gw_hp")
    assert tensorwise < rowwise < high_gw < bf16
    notes = gpu.block_times(llama8b("precision=float8"), 1, rates.spec_kernels(SPECS["a100"])).notes
    assert notes == ["this GPU has no FP8 tensor cores: float8 at bfloat16"]


def test_torchaos_shape_filter_keeps_small_linears_in_bf16_in_the_model_and_the_plan():
    """precision.filter_fqns's auto_filter_small_kn (TorchTitan's name for torchao's float8 shape
    filter): the 1B's linears the converter swaps, torchao's Float8Linear on a real meta model, are
    those the planner prices in float8; a model whose every linear the filter keeps is priced as
    bf16; without the filter nothing changes."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from titan_exp.models.llama import Transformer
    from titan_exp.perf.model.memory_gpu import float8_tensors
    from titan_exp.perf.model.shapes import low_precision_linears
    from titan_exp.precision import apply_converter

    auto = "precision.filter_fqns=[output,auto_filter_small_kn]"
    expected = {"float8": {"attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"},
                # the 1B: K, N <= 2048 stay bf16 under rowwise
                "float8_rowwise": {"feed_forward.w1", "feed_forward.w3"}}
    for preset, names in expected.items():
        job = resolve(compose_job(["model=llama3_1b", "model.n_layers=1", f"precision={preset}", auto]))
        with torch.device("meta"):
            model = Transformer(job.model)
        apply_converter(model, job.precision)
        swapped = {fqn.removeprefix("layers.0.") for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert swapped == names == low_precision_linears(job)
        plain = resolve(compose_job(["model=llama3_1b", f"precision={preset}"]))
        assert len(low_precision_linears(plain)) == 7
    named = resolve(compose_job(["model=llama3_1b", "precision=float8", "precision.filter_fqns=[output,attention]"]))
    assert low_precision_linears(named) == {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"}
    # The output layer: high precision as named by default; in float8 (its GEMMs and casts) where the list leaves it.
    default, head8 = (resolve(compose_job(["model=llama3_1b", "precision=float8", *o]))
                      for o in ([], ["precision.filter_fqns=[]"]))
    bf16 = gpu.block_times(resolve(compose_job(["model=llama3_1b", "precision=bf16"])), 1, K100)
    assert gpu.block_times(default, 1, K100).kinds["head"] == bf16.kinds["head"]
    head = gpu.block_times(head8, 1, K100).kinds["head"]  # float8 GEMMs, and the casts' bytes beside the loss's
    assert head["gemm"] < bf16.kinds["head"]["gemm"] and head["memory_bound"] > bf16.kinds["head"]["memory_bound"]
    # The 1B under rowwise with the filter: q, k, v and o priced as bf16's, w1 and w3 in float8.
    rowwise = gpu.block_times(resolve(compose_job(["model=llama3_1b", "precision=float8_rowwise", auto])), 1, K100)
    assert rowwise.tp_groups[:2] == bf16.tp_groups[:2] and rowwise.tp_groups[2] != bf16.tp_groups[2]
    kept_all = resolve(compose_job(["model=debugmodel", "precision=float8", auto]))  # every K <= 4096 and N <= 1024
    assert low_precision_linears(kept_all) == frozenset() and float8_tensors(kept_all, 1024) == []
    plain16 = resolve(compose_job(["model=debugmodel", "precision=bf16"]))
    for k in ("fwd", "bwd", "head"):
        assert (getattr(gpu.block_times(kept_all, 1, K100), k)
                == pytest.approx(getattr(gpu.block_times(plain16, 1, K100), k)))


@pytest.mark.parametrize("recipe", sorted(f8c.EAGER_CAST_KERNELS))
def test_eager_float8_casts_are_what_torchaos_linear_runs(recipe):
    """[torchao-eager] counted on torchao's own Float8Linear, forward and backward on CPU: every
    op on plain tensors but views, by the bytes it reads and writes. Each cast of a bf16 tensor is
    EAGER_CAST_KERNELS[recipe] kernels and EAGER_CAST_BYTES an element of it; the forward casts the
    input and the weight; the backward the output gradient twice and the weight and the input
    again (rowwise_with_gw_hp: the gradient once and the weight), as _cast_bytes prices them. The
    matmuls (through torchao's tensor subclass, or plain in bf16) are GEMMs, not counted here."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rows, k, n = 256, 512, 1024
    linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(rows, k, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, n, dtype=torch.bfloat16)
    kernels, moved = [0], [0]

    def physical(t):
        return math.prod(d for d, st in zip(t.shape, t.stride()) if st) * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if any(type(t) is not torch.Tensor for t in ins + outs):  # torchao's subclass: its matmul, its views
                return out
            if outs and {o.untyped_storage().data_ptr() for o in outs} <= {a.untyped_storage().data_ptr() for a in ins}:
                return out  # a view
            if func.__name__.split(".")[0] in ("mm", "_scaled_mm"):  # a GEMM (gw_hp's weight gradient in bf16)
                return out
            kernels[0] += 1
            if max(t.numel() for t in ins + outs) >= rows * k:  # a tensor's cast, not its scale's arithmetic
                moved[0] += sum(physical(t) for t in ins + outs)
            return out

    def count(fn):
        kernels[0] = moved[0] = 0
        with Count():
            fn()
        return kernels[0], moved[0]

    linear(x).backward(grad)  # once outside, so no first-call work is counted
    out = []
    fwd_kernels, fwd_bytes = count(lambda: out.append(linear(x)))
    bwd_kernels, bwd_bytes = count(lambda: out[0].backward(grad))
    per_cast, casts_back = f8c.EAGER_CAST_KERNELS[recipe], 2 if recipe == "rowwise_with_gw_hp" else 4
    assert (fwd_kernels, bwd_kernels) == (2 * per_cast, casts_back * per_cast)
    # within 1 %: the casts' reads of their scales (a scalar, or a row's or column's) are not priced
    assert fwd_bytes == pytest.approx(f8c.EAGER_CAST_BYTES * (rows * k + k * n), rel=1e-2)
    rescaled = {"rowwise": rows * k + k * n, "rowwise_with_gw_hp": rows * k}.get(recipe, 0)
    assert fwd_bytes + bwd_bytes + rescaled * f8c.RESCALE_BYTES["torchao"] == pytest.approx(
        f8c.cast_bytes(rows * k, k * n, rows * n, recipe, "torchao"), rel=1e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_torchaos_linear_under_autocast_casts_its_fp32_weight_and_its_gradients(recipe):
    """A single GPU's float8 linear: torchao's Float8Linear with an fp32 weight, its input fp32
    under bf16 autocast (CPU's), against the same linear in bf16. Forward, its casts move as many
    bytes (the fp32 weight cast to float8 at once, the input cast to bf16 by torchao as by
    autocast); backward, 6 bytes more a weight element and 6 more an input element, their
    gradients cast to fp32: Elementwise.autocast_weight_bytes's backward for every linear, and no
    forward weight cast beside the float8 one (perf.model.block)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rows, k, n = 256, 512, 1024

    def moved(fp32: bool) -> dict[str, float]:
        linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
        linear = linear if fp32 else linear.to(torch.bfloat16)
        convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(recipe))
        x = torch.randn(rows, k, dtype=torch.float32 if fp32 else torch.bfloat16, requires_grad=True)
        grad = torch.randn(rows, n, dtype=torch.bfloat16)
        by = {"weight": 0, "input": 0}

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                           if isinstance(t, torch.Tensor)]
                outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
                if (any(type(t) is not torch.Tensor for t in tensors)
                        or func.__name__.split(".")[0] in ("mm", "_scaled_mm")):
                    return out  # torchao's subclass (its matmul, its views), or a GEMM
                if {o.untyped_storage().data_ptr() for o in outs} <= {
                        t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}:
                    return out  # a view
                largest = max(t.numel() for t in tensors)
                if largest >= rows * k:  # a tensor's cast, not its scale's arithmetic
                    by["weight" if largest == k * n else "input"] += sum(
                        math.prod(d for d, st in zip(t.shape, t.stride()) if st) * t.element_size() for t in tensors)
                return out

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32):
            linear(x).backward(grad)  # once, so no first-call work is counted
            linear.zero_grad(set_to_none=True)  # and a first microbatch's backward, no gradient to add to
            x.grad = None
            with Count():
                y = linear(x)
        forward = dict(by)
        with Count():
            y.backward(grad)
        return {"weight_fwd": forward["weight"] / (k * n), "input_fwd": forward["input"] / (rows * k),
                "weight_bwd": (by["weight"] - forward["weight"]) / (k * n),
                "input_bwd": (by["input"] - forward["input"]) / (rows * k)}

    bf16, autocast = moved(False), moved(True)
    assert autocast["weight_fwd"] == pytest.approx(bf16["weight_fwd"], rel=1e-3)
    assert autocast["input_fwd"] == pytest.approx(bf16["input_fwd"], rel=1e-3)
    assert (autocast["weight_bwd"] - bf16["weight_bwd"]
            == pytest.approx(model_ops.LLAMA.autocast_weight_bytes[1], abs=0.05))
    assert autocast["input_bwd"] - bf16["input_bwd"] == pytest.approx(6, abs=0.1)


def test_a_rowwise_backward_gemm_rescales_its_output_after_tensorwise_cublas():
    """Without fast accumulation (torchao's rowwise backward GEMMs), addmm_float8_unwrapped runs
    the tensorwise GEMM and multiplies its bf16 output by the outer product of the row and column
    scales: counted on CPU, RESCALE_BYTES["torchao"] an output element, beside the GEMM."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8.float8_ops import addmm_float8_unwrapped

    m, k, n = 512, 128, 2048
    a, b = torch.randn(m, k).to(torch.float8_e4m3fn), torch.randn(n, k).to(torch.float8_e4m3fn).t()
    moved = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] != "_scaled_mm":  # the GEMM itself is priced as one
                tensors = torch.utils._pytree.tree_leaves((args, kwargs, out))
                moved[0] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

    with Count():
        addmm_float8_unwrapped(a, torch.rand(m, 1) + 1, b, torch.rand(1, n) + 1, torch.bfloat16, use_fast_accum=False)
    assert moved[0] == pytest.approx(f8c.RESCALE_BYTES["torchao"] * m * n, rel=1e-2)  # the scales' own bytes aside


def test_a_measured_forward_rate_prices_the_forward_float8_gemms_alone():
    """Where calibration measured torch._scaled_mm as torchao's forward GEMMs run (fast
    accumulation: `float8_fast`, tensorwise; `float8_rowwise`, rowwise scales), a float8 linear's
    forward GEMM runs at its recipe's rate; its backward GEMMs (tensorwise cuBLAS without fast
    accumulation in torchao) keep the float8 rate, and a bf16 linear under a float8 recipe (an
    MoE's routed experts) its bf16 one. A spec sheet has neither rate."""
    assert not {"float8_rowwise", "float8_fast"} & set(K100.matmul_tflops)
    rows, k, n = 8192.0, 4096.0, 14336.0
    for key, recipes in (("float8_rowwise", ("rowwise", "rowwise_with_gw_hp")), ("float8_fast", ("tensorwise",))):
        half = dataclasses.replace(K100, matmul_tflops={**K100.matmul_tflops, key: K100.matmul_tflops["float8"] / 2})
        for recipe in ("rowwise", "rowwise_with_gw_hp", "tensorwise"):
            before, after = (gpu.linear_s(kern, rows, k, n, "float8", "bfloat16", recipe, "compiled")
                             for kern in (K100, half))
            assert after[1:] == before[1:]
            assert after[0] == pytest.approx(2 * before[0] if recipe in recipes else before[0], rel=1e-3)
            bf16 = [gpu.linear_s(kern, rows, k, n, "bfloat16", "bfloat16", recipe, "compiled") for kern in (K100, half)]
            assert bf16[0] == bf16[1]


def test_calibration_times_float8_gemms_as_torchaos_linear_runs_them(monkeypatch):
    """measure_kernels.FLOAT8_GEMMS is what torchao's Float8LinearConfig asks cuBLAS for, recipe
    by recipe (fast accumulation in the forward GEMM, none in the gradients'), and
    matmul_tflops times each with those arguments where the device has float8 (on this CPU, with
    float8 allowed and torch._scaled_mm recorded)."""
    import torch
    import torch.distributed as dist
    from torchao.float8 import Float8LinearConfig

    from titan_exp.perf.calibration import kernels as mk
    from titan_exp.perf.calibration.timing import Options

    for recipe, forward in (("tensorwise", "float8_fast"), ("rowwise", "float8_rowwise"),
                            ("rowwise_with_gw_hp", "float8_rowwise")):
        config = Float8LinearConfig.from_recipe_name(recipe)
        assert config.gemm_config_output.use_fast_accum == mk.FLOAT8_GEMMS[forward][1]
        assert config.gemm_config_grad_input.use_fast_accum == mk.FLOAT8_GEMMS["float8"][1]
        assert config.gemm_config_grad_weight.use_fast_accum == mk.FLOAT8_GEMMS["float8"][1]
    calls, scaled_mm = [], torch._scaled_mm

    def recorded(a, b, scale_a, scale_b, **kw):
        calls.append((scale_a.numel() > 1, kw["use_fast_accum"]))
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    monkeypatch.setattr(mk, "matmul_dtypes", lambda device: [torch.bfloat16, torch.float8_e4m3fn])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rates = mk.matmul_tflops([64], 1, Options(tiny=True), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert set(rates) == {"bfloat16", *mk.FLOAT8_GEMMS} and all(r > 0 for r in rates.values())
    assert set(calls) == set(mk.FLOAT8_GEMMS.values())
    # A GPU whose cuBLAS refuses fast accumulation keeps the float8 rate for the forward GEMMs too.
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no fast accum"))
                        if kw["use_fast_accum"] else scaled_mm(*a, **kw))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert set(mk.matmul_tflops([64], 1, Options(tiny=True), torch.device("cpu"))) == {"bfloat16", "float8"}
    finally:
        dist.destroy_process_group()


def test_float8_casts_are_priced_at_the_rate_calibration_measured_for_them():
    """A float8 block's casts run at Kernels.float8_cast_tb_s's rate for its recipe and casts (the
    memory rate where none was measured): at half the memory rate they take twice as long, at a
    quarter four times, and nothing else of the block moves; rowwise_with_gw_hp takes rowwise's."""
    def kinds(job, rates):
        kern = dataclasses.replace(K100, float8_cast_tb_s=rates)
        t = gpu.block_times(job, 1, kern)
        return {k: sum(part.get(k, 0.0) for part in t.kinds.values()) for k in ("gemm", "attention", "memory_bound")}

    hbm = K100.memory_tb_s
    for recipe, compiled in (("tensorwise", True), ("rowwise", False), ("rowwise_with_gw_hp", True)):
        job = llama8b("precision=float8", f"precision.float8_recipe={recipe}",
                      f"compile.enable={str(compiled).lower()}")
        key = f"{'rowwise' if recipe != 'tensorwise' else recipe}/{'compiled' if compiled else 'torchao'}"
        base, same = kinds(job, {}), kinds(job, {key: hbm})
        half, quarter = kinds(job, {key: hbm / 2}), kinds(job, {key: hbm / 4})
        other = kinds(job, {f"tensorwise/{'torchao' if compiled else 'compiled'}": hbm / 4})  # another mode's rate
        assert same == base and other == base
        assert half["gemm"] == base["gemm"] and half["attention"] == base["attention"]
        cast = half["memory_bound"] - base["memory_bound"]
        assert cast > 0 and quarter["memory_bound"] - base["memory_bound"] == pytest.approx(3 * cast, rel=1e-9)
    measured = dataclasses.replace(K100, float8_cast_tb_s={"tensorwise/compiled": 0.9})
    assert Kernels.of(json.loads(json.dumps(measured.to_dict()))) == measured  # as a profile's file keeps it
    assert Kernels.of({k: v for k, v in K100.to_dict().items()
                       if k != "float8_cast_tb_s"}) == K100  # a file from before


@pytest.mark.slow  # times real float8 linears: a minute, and noisy on a shared machine
def test_calibration_measures_torchaos_float8_casts_where_float8_runs(monkeypatch):
    """measure_kernels.float8_cast_tb_s on this CPU (torchao's float8 linear runs here, its matmul
    emulated), with a float8 GEMM rate in the kernels as on an FP8 GPU: a rate for each recipe and
    mode asked, the float8 linear's step less its GEMMs priced at those kernels; none without a
    float8 rate (a GPU without FP8 tensor cores, or this CPU as calibration measures it)."""
    import torch
    import torch.distributed as dist

    from titan_exp.perf.calibration import kernels as mk
    from titan_exp.perf.calibration.timing import Options

    m = llama8b("model=debugmodel").model
    slow_gemms = dataclasses.replace(K100, matmul_tflops={k: 1e-3 for k in K100.matmul_tflops})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rates = mk.float8_cast_tb_s(K100, m, 256, Options(tiny=True), torch.device("cpu"), ("torchao",))
        none = mk.float8_cast_tb_s(dataclasses.replace(K100, matmul_tflops={"bfloat16": 1.0}), m, 256,
                                   Options(tiny=True), torch.device("cpu"), ("torchao",))
        # GEMMs priced slower than the whole linear ran: no remainder to be the casts', no rate
        left_out = mk.float8_cast_tb_s(slow_gemms, m, 256, Options(tiny=True), torch.device("cpu"), ("torchao",))
    finally:
        dist.destroy_process_group()
    assert set(rates) == {"tensorwise/torchao", "rowwise/torchao"} and all(0 < r < 1 for r in rates.values())
    assert none == {} and left_out == {}


def test_an_eager_float8_block_pays_for_torchaos_casts_and_python_on_the_host():
    """Without compile, each of a block's seven float8 linears adds its casts' kernels and
    torchao's Python (HOST_FLOAT8_S, or what calibrate measured) to the block's host time; its
    casts move EAGER_CAST_BYTES an element. So on a small model a float8 block is slower than a
    bf16 one, where compiled it is faster [torchao-eager]."""
    small = ("model=llama3_1b", "training.local_batch_size=1")
    eager8, eager16 = (gpu.block_times(llama8b(*small, *o), 1, K100) for o in (["precision=float8"], []))
    host = model_ops.LLAMA.eager_ops * K100.host_eager_s + 7 * (2 * 11 * K100.host_eager_s + f8c.HOST_FLOAT8_S)
    assert eager8.fwd == pytest.approx(host) and eager8.bwd == pytest.approx(2 * host)  # host-bound
    assert eager8.fwd + eager8.bwd > 2 * (eager16.fwd + eager16.bwd)
    measured = dataclasses.replace(K100, host_float8_s=0.0)
    assert gpu.block_times(llama8b(*small, "precision=float8"), 1, measured).fwd < eager8.fwd
    compiled8, compiled16 = (gpu.block_times(llama8b(*small, "compile.enable=true", *o), 1, K100)
                             for o in (["precision=float8"], []))
    assert compiled8.fwd + compiled8.bwd < compiled16.fwd + compiled16.bwd
    assert [n for n in eager8.notes if "compile.enable=true fuses the casts" in n] and not compiled8.notes


def test_float8_all_gather_sends_a_byte_a_weight_casts_the_shard_and_holds_less():
    """precision.float8_enable_fsdp_all_gather: the block's seven float8 linears travel a byte an
    element, after an amax all-reduce per weight (or one for them all a step, precomputed); their
    forward no longer casts the weight; the gathered block holds a byte less a weight."""
    from titan_exp.perf.model.memory import predict_memory
    from titan_exp.perf.model.shapes import float8_gathered

    short = ["training.seq_len=512", "training.local_batch_size=1", "training.global_batch_size=16",
             "parallelism.data_parallel_shard_degree=16", "cluster.nproc_per_node=8", "cluster.nnodes=2",
             "precision=float8", "compile.enable=true"]
    on = ["precision.float8_enable_fsdp_all_gather=true"]
    m = llama8b(*short).model
    linears = 2 * m.dim * (m.n_heads + m.kv_heads) * m.head_size + 3 * m.dim * m.ffn_hidden_dim
    assert float8_gathered(llama8b(*short, *on)) == (linears, 7)
    assert float8_gathered(llama8b(*short)) == (0, 0)
    ddp = ["parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=16"]
    assert float8_gathered(llama8b(*short, *on, *ddp)) == (0, 0)  # no FSDP: no such gather
    two_nodes = spec_profile(H100, 16, 8)
    bf16, f8, pre = (predict_step(llama8b(*short, *o), two_nodes, cuda=True) for o in
                     ([], on, [*on, "precision.float8_precompute_dynamic_scale_for_fsdp=true"]))
    # half the bytes a gather, less seven amax all-reduces (tiny: NCCL's LL latency) or one a step
    assert pre.parts["fsdp"] < f8.parts["fsdp"] < bf16.parts["fsdp"]
    assert f8.parts["compute"] < bf16.parts["compute"]  # the weight's cast left the forward
    saved = (predict_memory(llama8b(*short), cuda=True)["fsdp_working_set"]
             - predict_memory(llama8b(*short, *on), cuda=True)["fsdp_working_set"]) * 2**30
    # the working set's peak, at seq 512 (small logits): the last block's backward, the block gathered and
    # the next one prefetched, both a byte a float8 weight, beside the output's reduce-scatter input
    assert saved == pytest.approx(2 * linears)
