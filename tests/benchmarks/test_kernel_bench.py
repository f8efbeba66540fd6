"""benchmarks/kernel_bench.py, the kernel tool: its command line and what runs of it without a GPU
(`--help`, `micro --list`, `sweep --dry-run`, the sweep's choice of configs and dispatch limits,
the int4-stream probe's weight layout);
on a GPU, its timing helper and the cases `micro` times. `agree` runs on the CPU in
test_train_synthetic_lm.py."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "kernel_bench.py"
sys.path.insert(0, str(TOOL.parent))
import kernel_bench as kb  # noqa: E402

SUBCOMMANDS = {  # subcommand -> options its help must list
    "micro": ["--cases", "--list", "--no-compile", "--no-cuda-ext"],
    "attention": ["--cases", "--layers", "--no-sweep", "--prefill-tokens"],
    "sweep": ["--models", "--roles", "--tokens", "--budget-s", "--dry-run", "--json-out"],
    "tune": ["--source", "--rounds", "--tables"],
    "gemm-wq": ["--models", "--scheme", "--tokens", "--no-reference"],
    "int4-stream": ["--models", "--tokens"],
    "profile": ["--source", "--top", "--prefill"],
    "agree": ["--source", "--dtype", "--prompts-file", "--tokens"],
}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """The script as a user runs it: its own process, from the repository root."""
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_help_lists_every_subcommand():
    res = run_tool("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: kernel_bench.py")
    for name in SUBCOMMANDS:
        assert f"kernel_bench.py {name}" in res.stdout  # the docstring's command list
        assert f"\n    {name}" in res.stdout  # argparse's list of subcommands


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as exit:
        kb.main([name, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kernel_bench.py {name}")
    for option in SUBCOMMANDS[name]:
        assert option in out


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit:
        kb.main([])
    assert exit.value.code == 2 and "required" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
@pytest.mark.parametrize("args", [["micro"], ["attention"], ["sweep"], ["tune"], ["gemm-wq"], ["int4-stream"],
                                  ["profile"]])
def test_gpu_commands_say_they_need_a_gpu(args, capsys):
    assert kb.main(args) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_int4_stream_layout_makes_each_tile_group_unit_contiguous():
    # 4 tiles of 16 rows, 4 groups of 128 k (64 bytes of codes a row)
    g = torch.Generator().manual_seed(0)
    qweight = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(64, 4, generator=g), torch.rand(64, 4, generator=g)
    codes, scale_zero = kb.tile_contiguous(qweight, scale, zero, glu=False)
    units, pairs = codes.view(4, 4, 16, 64), scale_zero.view(4, 4, 16, 2)  # [tile][group][row]
    for tile in range(4):
        for group in range(4):
            rows = slice(16 * tile, 16 * tile + 16)
            assert torch.equal(units[tile, group], qweight[rows, 64 * group:64 * group + 64])
            assert torch.equal(pairs[tile, group, :, 0], scale[rows, group])
            assert torch.equal(pairs[tile, group, :, 1], zero[rows, group])


def test_int4_stream_layout_puts_gate_and_up_rows_of_a_tile_in_one_unit():
    # GLU: 32 gate rows then 32 up rows, 2 groups; a unit holds tile t's gate rows, then its up rows
    g = torch.Generator().manual_seed(1)
    qweight = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(64, 2, generator=g), torch.rand(64, 2, generator=g)
    codes, scale_zero = kb.tile_contiguous(qweight, scale, zero, glu=True)
    units, pairs = codes.view(2, 2, 2, 16, 64), scale_zero.view(2, 2, 2, 16, 2)  # [tile][group][gate|up][row]
    for tile in range(2):
        for group in range(2):
            for half in range(2):
                rows = slice(32 * half + 16 * tile, 32 * half + 16 * tile + 16)
                assert torch.equal(units[tile, group, half], qweight[rows, 64 * group:64 * group + 64])
                assert torch.equal(pairs[tile, group, half, :, 0], scale[rows, group])
                assert torch.equal(pairs[tile, group, half, :, 1], zero[rows, group])


def test_micro_lists_its_cases_without_a_gpu():
    res = run_tool("micro", "--list")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 13
    assert all(line.split()[-2:] == ["eager,", "triton"] for line in lines)  # no CUDA extension on a CPU
    names = [line.rsplit(None, 2)[0] for line in lines]
    assert "rms_norm_glu_mlp llama-3.2-1b T=1" in names
    assert "paged_attn decode qwen2.5-0.5b S=64 ctx=1024" in names
    assert "paged_attn prefill qwen2.5-0.5b T=1024" in names


def test_sweep_dry_run_prints_the_candidate_grid():
    res = run_tool("sweep", "--dry-run", "--models", "qwen2.5-0.5b", "--roles", "o", "down", "--tokens", "1", "2")
    assert res.returncode == 0, res.stderr
    head, *rows = res.stdout.splitlines()
    planned = kb.plan(kb.all_shapes(["qwen2.5-0.5b"], ["o", "down"]), [1, 2], [1])
    measurements = sum(len(groups) for groups in planned.values())
    assert head == f"2 shapes x 2 token counts: {measurements} measurements, {len(kb.compile_jobs(planned))} kernel compilations"
    assert [r.split()[:3] for r in rows] == [["qwen2.5-0.5b/o", "896x896", "T=1:"], ["qwen2.5-0.5b/o", "896x896", "T=2:"],
                                             ["qwen2.5-0.5b/down", "896x4864", "T=1:"],
                                             ["qwen2.5-0.5b/down", "896x4864", "T=2:"]]
    # o and down run the same GEMV kernels: a config both run is compiled once
    assert len(kb.compile_jobs(planned)) < measurements


def test_sweep_candidates_are_the_configs_a_launch_runs():
    o = kb.role_shape("qwen2.5-0.5b", "o")
    assert (o.N, o.K, o.table) == (896, 896, "gemv")
    groups = kb.plan([o], [1], [1])[(o, 1)]
    for eff, raws in groups.items():
        # raw configs grouped under one key run the same tile, and none holds too many accumulators
        assert {kb.effective(o, raw, 1) for raw in raws} == {eff}
        bt, rows, bk, warps, _ = eff
        assert bt * rows * bk / (32 * warps) <= kb.MAX_ACC_REGS


def test_sweep_chooses_the_config_best_over_all_shapes_of_a_table():
    a, b = kb.role_shape("qwen2.5-0.5b", "o"), kb.role_shape("llama-3.2-1b", "o")
    fast_a, fast_b = {"BLOCK_T": 1, "BLOCK_N": 1}, {"BLOCK_T": 1, "BLOCK_N": 2}
    results = {  # config 1 is best on a by a little, config 2 on b by a lot: 2 wins on the sum of ratios
        (a, 1): kb.Result(us={"e1": 1.0, "e2": 1.1}, raws={"e1": [fast_a], "e2": [fast_b]}),
        (b, 1): kb.Result(us={"e1": 3.0, "e2": 1.0}, raws={"e1": [fast_a], "e2": [fast_b]}),
    }
    assert kb.choose_tables(results, [1]) == {"gemv": {"1": fast_b, "inf": fast_b}}


@pytest.mark.parametrize("rows,limit", [
    ([(1, 2.0, 5.0), (2, 3.0, 5.0), (4, 6.0, 5.0), (8, 4.0, 9.0)], 2),  # 8 wins again but 4 lost: stop at 2
    ([(1, 6.0, 5.0), (2, 3.0, 5.0)], 1),  # one token always streams the weights
    ([(8, 1.0, 2.0), (1, 1.0, 2.0), (4, 1.0, 2.0)], 8),
])
def test_dispatch_limit_is_the_last_token_count_of_an_unbroken_run_of_wins(rows, limit):
    assert kb.decode_limit(rows) == limit


def test_micro_cases_build_arguments_their_reference_takes():
    for case in kb.micro_cases(with_cuda=False):
        if "T=1024" in case.name or "T=4096" in case.name:
            continue  # the same builders at sizes that are slow on a CPU in bf16
        args = case.make(0, "cpu")
        out = case.impls["eager"](*args)
        x = args[0]
        cfg = kb.model_config(case.name.split()[2 if "paged_attn" in case.name else 1])
        # the shapes of the model the case is named after
        assert x.shape[1:] == ((cfg.num_heads, cfg.head_dim) if "paged_attn" in case.name else (cfg.hidden_size,))
        first = out[0] if isinstance(out, tuple) else out
        assert first.shape[0] == x.shape[0] and first.dtype == kb.DTYPE and torch.isfinite(first).all(), case.name
        assert case.bytes > 0 and case.flops >= 0


@pytest.mark.parametrize("role", kb.ROLES)
def test_sweep_ops_call_their_reference_and_cublas_on_the_same_arguments(role):
    shape = kb.role_shape("qwen2.5-0.5b", role)
    op = kb.make_op(shape, 2, copies=2, device="cpu")
    assert len(op.arg_sets) == 2 and op.arg_sets[0][1 if role != "gate_up" else 2].shape == (shape.N, shape.K)
    ref, base = op.reference(*op.arg_sets[0]), op.cublas(*op.arg_sets[0])
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert ref.shape[0] == 2 and base.shape == (2, shape.N)
    if "prefill" in op.forms and role != "qkv":  # the GEMVs' cuBLAS form is torch alone
        assert kb.rel_err(op.forms["prefill"](*op.arg_sets[0]), op.reference(*op.arg_sets[0])) < 2e-2


@pytest.mark.gpu
@needs_gpu
def test_graph_time_us_replays_every_call_of_the_graph():
    a, b = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    us = kb.graph_time_us(lambda t: t.add_(1), [(a,), (b,)], calls=4, replays=3, rounds=2)
    # warm-up: each set once; then 1 + 2 x 3 replays of a graph that adds 2 to each
    assert a.item() == b.item() == 1 + 2 * (1 + 2 * 3)
    assert 0 < us < 1e3


@pytest.mark.gpu
@needs_gpu
def test_graph_time_us_is_device_time_per_call():
    cycles = 1 << 20
    sleep = lambda: torch.cuda._sleep(cycles)  # noqa: E731
    one, four = kb.graph_time_us(sleep, calls=1), kb.graph_time_us(sleep, calls=4)
    assert one == pytest.approx(four, rel=0.2)  # per call, whatever the graph holds
    assert kb.graph_time_us(lambda: torch.cuda._sleep(2 * cycles)) == pytest.approx(2 * one, rel=0.2)


@pytest.mark.gpu
@needs_gpu
def test_micro_cases_agree_with_their_reference():
    for case in kb.micro_cases(with_cuda=False):
        args = case.make(0)
        ref = case.impls["eager"](*args)
        assert kb.rel_err(case.impls["triton"](*args), ref) < 2e-2, case.name
