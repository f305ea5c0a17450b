"""The shape benchmarks/vision_bench.py measures: Qwen2.5-VL-7B's transformers config with N of its 28 decoder layers
(or the CPU check's tiny one), its random-init model, and the image batches every system trains on."""

from __future__ import annotations

QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}
QWEN25_VL_7B_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}
QWEN25_VL_TOKENS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                    "vision_end_token_id": 151653}
TINY_TEXT = {**QWEN25_VL_7B_TEXT, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "bos_token_id": None, "eos_token_id": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
TINY_VISION = {**QWEN25_VL_7B_VISION, "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
               "out_hidden_size": 64, "patch_size": 2, "window_size": 8, "fullatt_block_indexes": [1]}
TINY_TOKENS = {"image_token_id": 95, "video_token_id": 94, "vision_start_token_id": 93, "vision_end_token_id": 92}
"""The CPU check's shape (tests/reference_vision.py's tiny Qwen2.5-VL): 8x8-pixel images of 4 tokens."""

def vl_config(layers: int, tiny: bool):
    """transformers' Qwen2_5_VLConfig of the benchmark shape with `layers` decoder layers."""
    import transformers

    text = {**(TINY_TEXT if tiny else QWEN25_VL_7B_TEXT), "num_hidden_layers": layers}
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=TINY_VISION if tiny else QWEN25_VL_7B_VISION,
                                         tie_word_embeddings=False, **(TINY_TOKENS if tiny else QWEN25_VL_TOKENS),
                                         architectures=["Qwen2_5_VLForConditionalGeneration"])


def random_model(config, device: str):
    """The model of `config` with transformers' random init, in bf16 on `device`, SDPA attention."""
    import torch
    import transformers

    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch.float32)


# ----------------------------------------------------------------------------- the batches


class ImageBatches:
    """Seeded batches of `rows` rows of `seq_len` tokens, each row with `images` images evenly spaced (vision start,
    the image tokens, vision end), the rest random text; labels: the next token, -100 where it is an image token
    and at the end. `image_px` square images: the processor's patches (random pixels) and their grids."""

    def __init__(self, config, rows: int, seq_len: int, images: int, image_px: int, seed: int = 0):
        v = config.vision_config
        self.grid = image_px // v.patch_size
        self.image_tokens = self.grid * self.grid // v.spatial_merge_size ** 2
        if images * (self.image_tokens + 2) >= seq_len:
            raise ValueError(f"{images} images of {self.image_tokens} tokens do not fit rows of {seq_len} tokens")
        self.config, self.rows, self.seq_len, self.images, self.seed = config, rows, seq_len, images, seed
        self.patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def parts(self, step: int):
        """(input_ids [rows, seq_len], labels [rows, seq_len], pixel_values [patches, patch_dim], image_grid_thw)."""
        import torch

        c = self.config
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        low = 3 if c.text_config.vocab_size < 1000 else 1000  # text ids clear of the special tokens
        ids = torch.randint(low, min(c.vision_end_token_id, c.text_config.vocab_size) - 8, (self.rows, self.seq_len),
                            generator=g)
        span = self.seq_len // self.images
        for i in range(self.images):
            start = i * span + 1
            ids[:, start - 1] = c.vision_start_token_id
            ids[:, start:start + self.image_tokens] = c.image_token_id
            ids[:, start + self.image_tokens] = c.vision_end_token_id
        labels = torch.cat([ids[:, 1:], torch.full((self.rows, 1), -100)], dim=1)
        labels[labels == c.image_token_id] = -100
        count = self.rows * self.images
        pixels = torch.randn(count * self.grid * self.grid, self.patch_dim, generator=g)
        grids = torch.tensor([[1, self.grid, self.grid]] * count)
        return ids, labels, pixels, grids

    def batch(self, step: int):
        from megatrain_ray.messages import Batch, ImageInputs

        ids, labels, pixels, grids = self.parts(step)
        return Batch(ids, labels, images=ImageInputs(pixels, {"image_grid_thw": grids}))

    def epoch_of(self, step: int) -> float:
        return 0.0  # endless synthetic batches: no epochs


def batches_of(spec: dict, tokens: int):
    config = vl_config(spec["layers"], spec["tiny"])
    return ImageBatches(config, tokens // spec["seq_len"], spec["seq_len"], spec["images"], spec["image_px"])
