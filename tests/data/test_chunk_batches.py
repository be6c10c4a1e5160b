"""Rect batches from shards are formed chunk by chunk (`aspect_batches(groups=...)`): rect validation reads
each chunk once per pass, rect training visits the chunks in a seeded order; without chunks nothing changes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from yolokit.data import make_shapes
from yolokit.data.samplers import AspectRatioBatchSampler, RectBatchSampler, aspect_batches


def _set(n=203, chunk=17, seed=0):
    rng = np.random.default_rng(seed)
    shapes = rng.integers(40, 200, (n, 2))
    return shapes, np.arange(n) // chunk                              # 12 chunks, the last of 16 images


def _chunks_of(batches, groups):
    return [sorted(set(groups[b].tolist())) for b in batches]


def test_batches_are_cut_chunk_by_chunk_as_many_and_as_large_as_before():
    shapes, groups = _set()
    plain, grouped = aspect_batches(shapes, 8), aspect_batches(shapes, 8, groups)
    assert plain == [o.tolist() for o in np.array_split(np.argsort(shapes[:, 0] / shapes[:, 1], kind="stable"),
                                                       range(8, len(shapes), 8))]   # without chunks: as before
    assert [len(b) for b in grouped] == [len(b) for b in plain]
    assert sorted(i for b in grouped for i in b) == list(range(len(shapes)))
    spans = _chunks_of(grouped, groups)
    assert all(len(s) == 1 or (len(s) == 2 and s[1] == s[0] + 1) for s in spans)   # one chunk, or two neighbours
    assert max(len(s) for s in _chunks_of(plain, groups)) >= 5                       # what aspect alone gives
    order = np.concatenate(grouped)
    assert (np.diff(groups[order]) >= 0).all()                                       # chunk after chunk
    aspect = shapes[order, 0] / shapes[order, 1]
    for c in range(groups.max() + 1):                                # rising, falling, rising...: like joins like
        within = np.diff(aspect[groups[order] == c])
        assert (within >= 0).all() if c % 2 == 0 else (within <= 0).all()


def test_rect_validation_reads_the_chunks_in_order_on_every_rank():
    shapes, groups = _set()
    one = AspectRatioBatchSampler(shapes, 8, groups=groups)
    assert list(one) == aspect_batches(shapes, 8, groups)
    ranks = [list(AspectRatioBatchSampler(shapes, 8, rank=r, world_size=2, groups=groups)) for r in range(2)]
    assert ranks[0] == list(one)[0::2] and ranks[1] == list(one)[1::2]


@pytest.mark.parametrize("world, accumulate", [(1, 1), (2, 2)])
def test_rect_training_visits_the_chunks_in_a_seeded_order_and_resumes_exactly(world, accumulate):
    shapes, groups = _set()
    kw = dict(seed=5, accumulate=accumulate, world_size=world, groups=groups)
    samplers = [RectBatchSampler(shapes, 4, rank=r, **kw) for r in range(world)]
    everything = RectBatchSampler(shapes, 4, accumulate=accumulate * world, seed=5, groups=groups)
    first = samplers[0].batches[0]
    for epoch in (0, 1):
        for s in [*samplers, everything]:
            s.set_epoch(epoch)
        whole = list(everything)
        assert sorted(map(tuple, whole)) == sorted(map(tuple, everything.batches))   # each batch once
        starts = [int(groups[b[0]]) for b in whole]
        runs = [c for k, c in enumerate(starts) if k == 0 or c != starts[k - 1]]
        assert len(runs) == len(set(starts)) == groups.max() + 1                     # each chunk one run of batches
        ranks = [list(s) for s in samplers]                                          # shared out by step
        step = world * accumulate
        for k in range(0, len(whole), step):
            mine = [b for r in range(world) for b in ranks[r][k // world:k // world + accumulate]]
            assert sorted(map(tuple, mine)) == sorted(map(tuple, whole[k:k + step]))
        if epoch == 0:
            order0 = starts
    assert starts != order0 and samplers[0].batches[0] == first                     # new order, same batches
    samplers[0].set_epoch(1, start_step=3)                                            # resumed after 3 steps
    tail = list(samplers[0])
    samplers[0].set_epoch(1)
    assert tail == list(samplers[0])[3 * accumulate:]


def test_without_chunks_rect_training_is_unchanged():
    shapes, _ = _set()
    sampler = RectBatchSampler(shapes, 4, seed=5)
    sampler.set_epoch(2)
    order = torch.randperm(len(sampler.batches), generator=torch.Generator().manual_seed(7)).tolist()
    assert list(sampler) == [sampler.batches[i] for i in order]


@pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")
def test_a_rect_validation_pass_downloads_each_chunk_once(s3_env, distant_env, tmp_path):
    """40 val images in 10 chunks from the store at a distance (the relay counts the GETs): with a cache cap
    of three chunks, each chunk is downloaded once per pass (3 or 4 times when the batches ignored the
    chunks); with the default cap the split stays whole and a second pass downloads nothing."""
    from yolokit.data import DetectionDataset, build_dataloader
    from yolokit.data.store.shards import write_shards

    url = s3_env.bucket("chunk-batches") + "/set"
    write_shards(make_shapes(tmp_path / "set", seed=3, n_train=4, n_val=40, imgsz=96), url, chunk_bytes="12KB",
                 splits=["val"])
    chunks = [f"chunk-0-{i}.bin" for i in range(10)]
    for cap, second in (("30KB", 1), ("25GB", 0)):
        shards = {"max_cache": cap, "cache_dir": str(tmp_path / f"cache-{cap}")}
        dataset = DetectionDataset(f"{url}/val", "val", imgsz=96, rect=True, shards=shards)
        assert dataset.index.store.files == chunks and dataset.index.store.total_bytes > 3 * 30 * 1024 // 2
        loader = build_dataloader(dataset, 4, workers=0, shuffle=False)
        for expected in (1, second):
            distant_env.reset()
            assert sum(len(b["indices"]) for b in loader) == 40
            assert [distant_env.gets(f"/set/val/{c}") for c in chunks] == [expected] * 10
