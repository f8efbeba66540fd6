"""benchmarks/megakernel_variants.py: how a variant on its command line is read, and that a
variant may be another copy of the kernel file (the kernel a change replaces), loaded beside
this tree's. Timing itself needs a GPU (its launches are the megakernel's own, tested in
tests/megakernel)."""

import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "megakernel_variants.py"
sys.path.insert(0, str(TOOL.parent))
import megakernel_variants as mv  # noqa: E402

from compiled_llm.megakernel import triton_kernel  # noqa: E402


def test_a_variant_names_a_kernel_its_warps_and_the_sizes_it_overrides():
    assert mv.parse_variant("new") == ("new", {}, {})
    sizes = {"BLOCK_L": 128, "PREFETCH": 1}
    assert mv.parse_variant("new,w=4,BLOCK_L=128,PREFETCH=1") == ("new", {"num_warps": 4, "sizes": sizes}, sizes)
    assert mv.parse_variant("/tmp/main_kernel.py,w=4") == ("/tmp/main_kernel.py", {"num_warps": 4}, {})


def test_another_copy_of_the_kernel_file_loads_as_its_own_module(tmp_path):
    copy = tmp_path / "main_kernel.py"
    copy.write_text(Path(triton_kernel.__file__).read_text())
    other = mv.kernel_module(str(copy))
    assert mv.kernel_module("new") is triton_kernel
    assert other is not triton_kernel and other.__file__ == str(copy)
    assert callable(other.launch) and other.megakernel is not triton_kernel.megakernel
