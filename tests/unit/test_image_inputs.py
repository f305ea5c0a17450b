"""ImageInputs through pickle (megatrain_ray/messages.py): the batch's pixels travel as out-of-band buffers (what Ray
writes to its object store and hands the GPU worker without a copy), not inside the pickle, and come back equal."""

from __future__ import annotations

import pickle

import torch

from megatrain_ray.messages import Batch, ImageInputs


def test_pixels_travel_out_of_band_and_come_back_equal():
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(64, 24, generator=g)
    extra = {"image_grid_thw": torch.tensor([[1, 4, 8], [1, 4, 8]]),
             "scales": torch.randn(2, 3, generator=g).to(torch.bfloat16), "one": torch.tensor(7)}
    batch = Batch(torch.arange(12).reshape(2, 6), torch.arange(12).reshape(2, 6), images=ImageInputs(pixels, extra))
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    out_of_band = sum(memoryview(b).nbytes for b in buffers)
    assert out_of_band >= pixels.numel() * 4 and len(data) < pixels.numel() * 4 / 2
    back = pickle.loads(data, buffers=buffers).images
    assert back.pixel_values.dtype == pixels.dtype and torch.equal(back.pixel_values, pixels)
    assert set(back.extra) == set(extra)
    for key, value in extra.items():
        assert back.extra[key].dtype == value.dtype and back.extra[key].shape == value.shape
        assert torch.equal(back.extra[key], value), key
    assert back.count == 2  # images by their grids, not the patches' rows
    plain = pickle.loads(pickle.dumps(batch))  # protocol without out-of-band buffers: the same values
    assert torch.equal(plain.images.pixel_values, pixels)
