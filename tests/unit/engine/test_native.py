"""The C++ kernels' builder (`engine/native.py`): a build lock left by a killed process does not hang later starts, a
kernel's name follows the torch it is built against, and every function is bound to release the GIL."""

from __future__ import annotations

import os
from pathlib import Path

from shardmesh.engine import native


def test_a_lock_older_than_any_build_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    assert not native._remove_stale_lock(lock)  # none there
    lock.touch()
    now = lock.stat().st_mtime
    assert not native._remove_stale_lock(lock, now + native.STALE_LOCK_S - 1)  # a build may be running
    assert lock.exists()
    assert native._remove_stale_lock(lock, now + native.STALE_LOCK_S)
    assert not lock.exists()


def test_a_stale_lock_in_the_build_directory_does_not_block_the_build(tmp_path: Path, monkeypatch) -> None:
    """A fresh builder over a build directory holding a stale lock builds (or loads) the kernel instead of waiting
    for that lock forever."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    kernel = native.InlineKernel("shardmesh_native_test", "int twice(int x) { return 2 * x; }", ["twice"], ["-O1"])
    build = Path(cpp_extension._get_build_directory(kernel.name, verbose=False))
    (build / "lock").touch()
    old = (build / "lock").stat().st_mtime - native.STALE_LOCK_S - 1
    os.utime(build / "lock", (old, old))
    module = kernel.module()
    assert module is not None, kernel.build_error
    assert module.twice(21) == 42


def test_a_kernels_name_does_not_depend_on_what_the_process_loaded_before(monkeypatch) -> None:
    """`load_inline` appends torch's link flags to the flag lists it is given; were they shared, every kernel loaded
    after the first would carry another name (another digest) in each process, depending on the order of loads, and
    a worker would build again what the cache already holds."""
    from torch.utils import cpp_extension

    def load_inline(name: str, **kwargs: list[str]) -> object:
        for flags in (kwargs["extra_cflags"], kwargs["extra_ldflags"]):
            flags += ["-L/torch/lib", "-lc10"]  # what torch does to the lists it is handed
        return object()

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    first = native.InlineKernel("shardmesh_native_first", "int one() { return 1; }", ["one"], ["-O1"])
    second = native.InlineKernel("shardmesh_native_second", "int two() { return 2; }", ["two"], ["-O1"])
    name = second.name
    assert first.module() is not None and second.module() is not None
    assert second.name == name and native.OPENMP == ("-fopenmp",)


def test_a_kernel_built_against_another_environments_torch_has_another_name(monkeypatch) -> None:
    """The build file names torch's header directories, so a build dir shared by two virtual environments was rebuilt
    by each in turn, silently (the build looked cached). Each environment's torch gets a name, and a build, of its
    own; the same environment keeps its name."""
    from torch.utils import cpp_extension

    kernel = native.InlineKernel("shardmesh_native_where", "int one() { return 1; }", ["one"], ["-O1"])
    here = kernel.name
    assert kernel.name == here
    other = [p.replace("site-packages", "elsewhere/site-packages") for p in cpp_extension.include_paths()]
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *args, **kwargs: other)
    assert kernel.name != here and kernel.name.startswith("shardmesh_native_where_")


def test_every_function_is_bound_to_release_the_gil() -> None:
    """Each function runs without the GIL (the module docstring says why). The shared-memory links' and collectives'
    tests, whose sides are threads of one process, depend on it: one side waits inside a kernel for the other's."""
    kernel = native.InlineKernel("shardmesh_native_gil", "int one() { return 1; }\nint two() { return 2; }",
                                 ["one", "two"], ["-O1"])  # fmt: skip
    source = kernel.bound_source
    assert source.startswith(native.HEADERS + "\nint one() { return 1; }\nint two() { return 2; }")
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in source and source.count("m.def(") == 2
    for f in ("one", "two"):
        assert f'm.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");' in source


def test_a_kernel_is_compiled_against_the_lean_headers_and_has_the_tensor_api(tmp_path: Path, monkeypatch) -> None:
    """The build's source starts with HEADERS, not <torch/extension.h> (most of a build's time went to parsing that),
    and what the kernels use compiles and runs with them: tensors and their dtypes, `torch::empty(_like)`, dispatch on
    a dtype, `at::parallel_for`, a tuple back to Python."""
    import torch
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = r"""
std::tuple<torch::Tensor, int64_t> doubled(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "contiguous input");
  auto out = torch::empty_like(x);
  auto sizes = torch::empty({1}, x.options().dtype(torch::kLong));
  sizes.data_ptr<int64_t>()[0] = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "doubled", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = src[i] * scalar_t(2);
    });
  });
  return {out, sizes.data_ptr<int64_t>()[0]};
}
"""
    kernel = native.InlineKernel("shardmesh_native_api", source, ["doubled"], ["-O1"])
    module = kernel.module()
    assert module is not None, kernel.build_error
    built = (Path(cpp_extension._get_build_directory(kernel.name, verbose=False)) / "main.cpp").read_text()
    assert built.startswith(native.HEADERS) and "torch/extension.h" not in built
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.arange(6, dtype=dtype)
        out, n = module.doubled(x)
        assert torch.equal(out, x * 2) and out.dtype == dtype and n == 6
