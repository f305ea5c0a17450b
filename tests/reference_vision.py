"""Tiny random vision-language models (saved with save_pretrained) and their batches, and the transformers model
trained as megatrain is configured: the reference of tests/integration/test_vision_parity.py.

LLaVA: a Llama text model (hidden 64, GQA 4/2, 2 layers, untied head) and a CLIP tower (16x16 images in 4x4 patches:
16 patch tokens per image after its CLS is dropped, feature layer -2), the two-layer GELU projector. Gemma 3: its text
model (3 layers, sliding window 6 in the local ones, tied head) and a SigLIP tower (16 patches pooled to 4 tokens per
image by the projector's average pool, its RMSNorm and matrix). Qwen2.5-VL: its Qwen2 text model (2 layers, M-RoPE
sections 2/3/3 of 8 frequencies) and its ViT (2 blocks, window attention in the first, 2x2 patches over 2 frames,
merged 2x2 by the merger): images of 4, 8 and 4 tokens between vision start and end tokens, its M-RoPE tables in
float64 on the reference side (recomposed by transformers' own code). Qwen3-VL: its Qwen3 text model (hidden 48, 3
layers, q/k norms, interleaved M-RoPE 2/3/3) and its ViT (3 blocks, learned positions on a 3x3 grid resampled to each
image, deepstack features from blocks 0 and 1, each through its own merger, added after text layers 0 and 1);
Qwen3-VL-MoE the same with 5 experts of width 20, top 2, the middle layer a dense MLP. Each batch has three rows of 24
tokens: two images in the first, none in the second, one in the third; image tokens never in the loss.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.conftest import one_thread
from tests.reference_hf import default_inv_freq64, float64_throughout
from tests.reference_llama import reference_lr

VOCAB, SEQ = 96, 24
LLAVA_IMAGE, GEMMA_IMAGE, GEMMA_BOI, GEMMA_EOI = 95, 93, 91, 92
QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 95, 94, 93, 92
QWEN_GRIDS = ((1, 4, 4), (1, 4, 8), (1, 4, 4))
"""Qwen-VL's images of a batch: (time, height, width) patches of 2x2 pixels, merged 2x2 into 4, 8 and 4 tokens."""
QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def build(name: str, directory, seed: int = 0):
    """The tiny model `name` (llava, gemma3), saved to `directory`; returns the model."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "llava":
        text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              tie_word_embeddings=False)
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=16, patch_size=4, projection_dim=32)
        model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(text_config=text, vision_config=vision,
                                                                image_token_id=LLAVA_IMAGE, vision_feature_layer=-2))
    elif name == "gemma3":
        text = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                   query_pre_attn_scalar=16, max_position_embeddings=128,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=16, patch_size=4, vision_use_head=False)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=GEMMA_IMAGE,
            boi_token_index=GEMMA_BOI, eoi_token_index=GEMMA_EOI))
        with torch.no_grad():  # its zero-initialised projector matrix and norms would hide every image
            for n, p in model.named_parameters():
                if "multi_modal_projector" in n or "norm" in n:
                    p.normal_(0.0, 0.3)
    elif name == "qwen2_5_vl":
        text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                "bos_token_id": None, "eos_token_id": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 8, "fullatt_block_indexes": [1],
                  "out_hidden_size": 64, "in_channels": 3}
        model = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO,
            vision_start_token_id=QWEN_START, vision_end_token_id=QWEN_END))
    elif name in ("qwen3_vl", "qwen3_vl_moe"):
        text = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
                "bos_token_id": None, "eos_token_id": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                    "mrope_interleaved": True}}
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 56, "num_heads": 2, "patch_size": 2,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 48, "in_channels": 3,
                  "num_position_embeddings": 9, "deepstack_visual_indexes": [0, 1]}
        tokens = {"image_token_id": QWEN_IMAGE, "video_token_id": QWEN_VIDEO, "vision_start_token_id": QWEN_START,
                  "vision_end_token_id": QWEN_END}
        if name == "qwen3_vl":
            model = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(text_config=text, vision_config=vision,
                                                                        **tokens))
        else:  # 5 experts of width 20 (the fused tensors not square), top 2, the middle layer a dense MLP
            text |= {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 20, "mlp_only_layers": [1]}
            model = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                                                                              **tokens))
            with torch.no_grad():  # a router drawn with std 0.02 scores the experts within float32 rounding of one
                for n, p in model.named_parameters():  # another: float32 and float64 would route differently
                    if ".mlp.gate." in n:
                        p.normal_(0.0, 0.5)
    else:
        raise ValueError(name)
    model.save_pretrained(str(directory))
    return model.eval()


def image_tokens(name: str) -> tuple[int, int]:
    """(image token id, tokens per image)."""
    return (LLAVA_IMAGE, 16) if name == "llava" else (QWEN_IMAGE, 4) if name in QWEN_FAMILIES else (GEMMA_IMAGE, 4)


def in_tower(name: str, key: str) -> bool:
    """Whether a module name is the vision tower's (frozen with finetune.vision=frozen), not the projector's."""
    if name in QWEN_FAMILIES:  # Qwen3-VL's deepstack mergers count with the tower, as LLaMA-Factory's
        return key.startswith("model.visual.") and not key.startswith("model.visual.merger.")
    return "vision_tower" in key


def image_inputs(pixels):
    """The batch's ImageInputs: the pixels, and Qwen2.5-VL's image grids with them."""
    from megatrain_ray.messages import ImageInputs

    if isinstance(pixels, tuple):
        return ImageInputs(pixels[0], {"image_grid_thw": pixels[1]})
    return ImageInputs(pixels)


def other_pixels(pixels):
    """Other random pixels of the same images."""
    return (torch.randn_like(pixels[0]), pixels[1]) if isinstance(pixels, tuple) else torch.randn_like(pixels)


def batch(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [3, SEQ], labels [3, SEQ], pixel_values [3, 3, 16, 16]): row 0 two images, row 1 none, row 2 one."""
    g = torch.Generator().manual_seed(seed)
    token, n = image_tokens(name)
    ids = torch.randint(3, 90, (3, SEQ), generator=g)

    def place(row: int, start: int) -> None:
        if name == "gemma3":  # <start_of_image> n x <image> <end_of_image>, as Gemma 3's processor writes it
            ids[row, start - 1], ids[row, start + n] = GEMMA_BOI, GEMMA_EOI
        ids[row, start:start + n] = token
    if name == "llava":
        ids = torch.randint(3, 90, (3, 2 * 16 + 8), generator=g)
        place(0, 2), place(0, 20), place(2, 5)
    elif name in QWEN_FAMILIES:  # <|vision_start|> image tokens <|vision_end|>, as Qwen-VL's processor writes them
        for row, start, n in ((0, 2, 4), (0, 10, 8), (2, 6, 4)):
            ids[row, start - 1], ids[row, start:start + n], ids[row, start + n] = QWEN_START, token, QWEN_END
    else:
        place(0, 2), place(0, 10), place(2, 6)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    labels[labels == token] = -100
    labels[ids == token] = -100
    if name in QWEN_FAMILIES:
        grids = torch.tensor(QWEN_GRIDS)
        return ids, labels, (torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g), grids)
    pixels = torch.randn(3, 3, 16, 16, generator=g)
    return ids, labels, pixels


def hf_inputs(name: str, model, ids: torch.Tensor, pixels) -> dict:
    if name in QWEN_FAMILIES:
        return {"input_ids": ids, "pixel_values": pixels[0].to(model.dtype), "image_grid_thw": pixels[1],
                "mm_token_type_ids": (ids == QWEN_IMAGE).to(torch.int32)}
    out = {"input_ids": ids, "pixel_values": pixels.to(model.dtype)}
    if name == "gemma3":
        out["token_type_ids"] = (ids == GEMMA_IMAGE).long()
    return out


def hf_logits(name: str, model, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(**hf_inputs(name, model, ids, pixels)).logits


def float64_language_model(model) -> None:
    """The language model of a float64 `model` in float64 throughout (tests/reference_hf.float64_throughout: its
    RoPE tables and RMSNorms, which transformers computes in float32), as megatrain's native templates compute it;
    the vision tower and projector as transformers computes them (megatrain runs those very modules: Gemma 3's
    projector norm rounds through float32 on both sides)."""
    model.set_attn_implementation("sdpa")
    if getattr(model.config.get_text_config(), "num_experts", 0):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    float64_throughout(model.model.language_model)
    for module in model.model.language_model.modules():
        if hasattr(module, "mrope_section"):
            _mrope_in_float64(module)


def _mrope_in_float64(module) -> None:
    """Qwen2.5-VL's M-RoPE tables in float64 for float64 inputs: its angles of the three position axes in float64,
    recomposed by its own recomposition_frequencies (transformers computes them in float32)."""
    eager = type(module).forward.__get__(module)

    def forward(x, position_ids):
        if x.dtype != torch.float64:
            return eager(x, position_ids)
        inv_freq = default_inv_freq64(module.config.rope_parameters["rope_theta"], module.inv_freq)
        freqs = position_ids.expand(3, -1, -1)[..., None].to(torch.float64) * inv_freq
        return module.recomposition_frequencies(freqs.cos()), module.recomposition_frequencies(freqs.sin())

    module.forward = forward


def exact(model):
    """A float64 copy, its language model in float64 throughout."""
    model = copy.deepcopy(model).to(torch.float64)
    float64_language_model(model)
    return model


def train_hf_vision(name: str, model, cfg, batches, dtype: torch.dtype, vision: str):
    """The transformers model trained with AdamW (matrices decayed) and clip_grad_norm_ over the trained parameters
    as megatrain is configured: the language model in full, the projector, and the tower with vision=full. Returns
    (losses, state by module name)."""
    with one_thread():
        model = copy.deepcopy(model).to(dtype).train()
        if dtype == torch.float64:
            float64_language_model(model)
        for n, p in model.named_parameters():
            p.requires_grad_(vision == "full" or not in_tower(name, n))
        trained = [p for p in model.parameters() if p.requires_grad]
        o, s = cfg.optimizer, cfg.schedule
        opt = torch.optim.AdamW([{"params": [p for p in trained if p.ndim >= 2], "weight_decay": o.weight_decay},
                                 {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}],
                                lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
        losses = []
        for step, (ids, labels, pixels) in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = reference_lr(step, o.lr, len(batches), s.warmup_steps, s.kind, s.min_lr_ratio)
            opt.zero_grad(set_to_none=True)
            logits = model(**hf_inputs(name, model, ids, pixels)).logits
            work = torch.promote_types(logits.dtype, torch.float32)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), labels.reshape(-1))
            loss.backward()
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trained, o.grad_clip)
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
