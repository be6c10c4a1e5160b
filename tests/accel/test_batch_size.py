"""find_batch_size, the memory model and is_oom_error, with injected OOMs."""

import pytest
import torch

from yolokit.accel import batch_size as bs
from yolokit.accel.batch_size import (
    MemoryModel,
    find_batch_size,
    fit_memory_model,
    free_memory,
    is_oom_error,
    predict_batch_size,
)


@pytest.fixture(autouse=True)
def no_gc(monkeypatch):
    """free_memory() runs gc.collect(), which takes ~0.1 s per trial in a test process."""
    calls = []
    monkeypatch.setattr(bs, "free_memory", lambda: calls.append(1))
    return calls


def oom_above(limit: int, tried: list[int]):
    def step(size: int) -> None:
        tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"injected at {size}")

    return step


def test_binsearch_finds_the_exact_limit():
    tried = []
    assert find_batch_size(oom_above(20, tried), mode="binsearch", margin=0.0) == 20
    assert tried == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]


def test_power_mode_and_margin():
    assert find_batch_size(oom_above(20, []), mode="power", margin=0.0) == 16
    assert find_batch_size(oom_above(20, []), mode="binsearch", margin=0.1) == 18
    assert find_batch_size(oom_above(1000, []), start=3, max_size=100, margin=0.0) == 100
    tried = []
    assert find_batch_size(oom_above(10**6, tried), max_size=40, margin=0.0) == 40
    assert tried == [1, 2, 4, 8, 16, 32, 40]


def test_memory_is_freed_between_trials(no_gc):
    tried = []
    find_batch_size(oom_above(5, tried), mode="binsearch")
    assert tried == [1, 2, 4, 8, 6, 5] and len(no_gc) == len(tried)
    free_memory()  # the real one (imported before the patch) runs without CUDA too


def test_start_must_fit_and_other_errors_propagate():
    with pytest.raises(RuntimeError, match="batch size 8 does not fit"):
        find_batch_size(oom_above(4, []), start=8)

    def broken(size):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError, match="not an OOM"):
        find_batch_size(broken)
    with pytest.raises(ValueError):
        find_batch_size(oom_above(4, []), mode="linear")


def test_memory_model_fit_and_prediction():
    model = fit_memory_model([1, 2, 4, 8], [100 + 10 * b for b in (1, 2, 4, 8)])
    assert model.fixed_bytes == pytest.approx(100.0) and model.per_sample_bytes == pytest.approx(10.0)
    assert model.predict(30) == pytest.approx(400.0)
    assert model.batch_size_for(805.0) == 70 and model.batch_size_for(50.0) == 0
    with pytest.raises(ValueError):
        fit_memory_model([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError):
        MemoryModel(100.0, 0.0).batch_size_for(1000.0)


def test_predict_batch_size_cross_checks_with_a_search():
    measure = lambda b: 100 + 10 * b  # noqa: E731
    kwargs = dict(fraction=0.8, total_bytes=1000.0, measure=measure, refine=False)
    assert predict_batch_size(oom_above(1000, []), **kwargs) == 70  # (800 - 100) / 10, and it fits
    assert predict_batch_size(oom_above(60, []), verify=False, **kwargs) == 70
    tried = []
    assert predict_batch_size(oom_above(60, tried), **kwargs) == 60  # prediction OOMs: search below it
    assert tried[0] == 70 and max(tried) <= 70
    assert predict_batch_size(oom_above(1000, []), max_size=32, **kwargs) == 32


def _h100_like(total: float, tried: list[int]):
    """A step and its peak (MiB) as yolov8s measured on an H100 (2026-11-27): 199.6 MiB an image over
    1-8 images, 194.9 beyond; the step runs out of memory above ``total``."""

    def peak(b: int) -> float:
        return 186 + 199.6 * b if b <= 8 else 1782.8 + 194.9 * (b - 8)

    def step(b: int) -> None:
        tried.append(b)
        if peak(b) > total:
            raise torch.OutOfMemoryError(f"{b} images")

    def measure(b: int) -> float:
        step(b)
        return peak(b)

    return step, measure


@pytest.mark.parametrize("fraction", [0.9, 0.95])
def test_the_refined_prediction_reaches_the_fraction_of_the_true_largest_batch(fraction):
    total = 80548.0                                  # 78.66 GiB in MiB: 412 images fit, 413 do not
    largest = find_batch_size(_h100_like(total, [])[0], start=8, max_size=1024, mode="binsearch", margin=0.0)
    assert largest == 412
    got = {}
    for refine in (False, True):
        tried = []
        step, measure = _h100_like(total, tried)
        got[refine] = predict_batch_size(step, fraction=fraction, total_bytes=total, measure=measure, refine=refine)
        assert len(set(tried)) <= 6                  # 1, 2, 4, 8, the first prediction, the refined one
    assert got[False] / largest < fraction - 0.015   # the line through 1-8 images falls short
    assert fraction - 0.005 <= got[True] / largest <= fraction, got


def test_a_first_prediction_that_runs_out_of_memory_is_searched_below_once():
    tried = []
    step, measure = _h100_like(30000.0, tried)      # 30 GB: 152 images fit
    got = predict_batch_size(step, fraction=1.2, total_bytes=30000.0, measure=measure)   # predicts 149 / 0.8
    assert got == 152 and tried.count(max(tried)) == 1   # the failed size is not run again


def test_what_counts_as_out_of_memory():
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom_error(RuntimeError("CUDNN_STATUS_BAD_PARAM"))
    assert not is_oom_error(ValueError("CUBLAS_STATUS_ALLOC_FAILED"))
    # the CUDA runtime (a kernel launch, a library's cudaMalloc) and NCCL (DistBackendError is a RuntimeError)
    assert is_oom_error(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"))
    assert is_oom_error(RuntimeError("cudaErrorMemoryAllocation"))
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
            "NCCL version 2.28.9\nncclUnhandledCudaError: Call to CUDA function failed.\n"
            "Last error:\nCuda failure 2 'out of memory'")
    assert is_oom_error(torch.distributed.DistBackendError(nccl))
    assert not is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom_error(RuntimeError("DataLoader worker (pid 7) ran out of memory"))   # host memory: not ours


def test_finder_treats_cudnn_allocation_failures_as_oom():
    def step(size):
        if size > 12:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")

    assert find_batch_size(step, mode="binsearch", margin=0.0, max_size=64) == 12

    def broken(size):
        raise RuntimeError("size mismatch")

    with pytest.raises(RuntimeError, match="size mismatch"):
        find_batch_size(broken)


@pytest.mark.gpu
def test_real_cuda_oom_is_found_and_predicted(monkeypatch):
    monkeypatch.setattr(bs, "free_memory", lambda: torch.cuda.empty_cache())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    base = torch.cuda.memory_allocated()
    budget = base + 2**30  # cap this process at ~1 GiB above what it holds now
    torch.cuda.set_per_process_memory_fraction(budget / total)
    per_sample = 32 * 2**20  # each image: a 32 MiB activation and its 32 MiB square

    def step(b: int) -> None:
        a = torch.ones(b, per_sample // 4, device="cuda")
        (a * a).sum().item()

    try:
        found = find_batch_size(step, mode="binsearch", margin=0.0, max_size=64)
        assert 8 <= found < 16  # 1 GiB / 64 MiB = 16, less allocator overhead
        step(found)
        with pytest.raises(torch.OutOfMemoryError):
            step(found + 1)
        torch.cuda.empty_cache()
        predicted = predict_batch_size(step, fraction=1.0, total_bytes=budget, probe_sizes=(1, 2, 4), verify=True)
        assert abs(predicted - found) <= 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
